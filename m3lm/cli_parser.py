"""The `m3lm` command's arguments: every flag with its help and its default, every command with
a one-line description and an example. Imports nothing heavy, so `--help` and `--version`
answer at once."""

from __future__ import annotations

import argparse
import math
import re

from m3lm.config import SESSION_CONTEXT
from m3lm.threads import MAX_DEFAULT_THREADS, SMALL_MODEL_PARAMS


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; each flag's default after its help, unless the help
    already says it (a default that depends on the model or the machine)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        quiet = default is None or isinstance(default, bool) or default is argparse.SUPPRESS or default == ""
        if "default" in text or quiet or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return n


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "20GiB", "512 MiB" or "1.5GB" (KiB = 1024 bytes, KB = 1000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and SIZE_UNITS.get(m.group(2).lower())
    if unit is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or e.g. 20GiB, 512MiB, 1.5GB)")
    n = int(float(m.group(1)) * unit) if "." in m.group(1) else int(m.group(1)) * unit
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return n


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a number in (0, 1]")
    return v


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0 to 65535)")
    return n


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds")
    return v


def _model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a local checkpoint directory: config.json, safetensors and tokenizer files; m3lm never "
        "downloads (default: the embedded story model, m3lm.DEFAULT_MODEL)",
    )


def _device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when a CUDA GPU is visible, else cpu)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "fp32", "bfloat16", "bf16"],
        help="float32 or bfloat16 (default: bfloat16 on a GPU, float32 on the CPU)",
    )
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        metavar="N",
        help=f"torch's threads on the CPU, in the process that runs the model (default: 1 for a model "
        f"under {SMALL_MODEL_PARAMS // 10**6}M parameters, else min({MAX_DEFAULT_THREADS}, cores)); "
        "ignored on a GPU",
    )


def _dense_window(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--msa-dense-window",
        type=float,
        default=None,
        metavar="F",
        help="an approximation that changes outputs: attend densely while the selected blocks cover "
        "at least 1/F of the context (default: off, exact MSA)",
    )


def _speculative_config(text: str):
    from m3lm.errors import ConfigError
    from m3lm.speculative.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except (ConfigError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_events_config(text: str):
    from m3lm.errors import ConfigError
    from m3lm.kv_events_config import KVEventsConfig

    try:
        return KVEventsConfig.parse(text)
    except (ConfigError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": '
        '3, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "eagle3", "model": DIR, '
        '"num_speculative_tokens": 3}; outputs are those of plain decoding (default: off)',
    )


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system prompt (default: none)")
    p.add_argument(
        "--max-tokens", type=_positive, default=256, metavar="N", help="tokens to generate at most"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 is greedy (default: the checkpoint's generation_config.json, else 1.0)",
    )
    p.add_argument("--top-p", type=float, default=None, help="(default: generation_config.json, else 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="(default: generation_config.json, else off)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-text token")
    p.add_argument(
        "--thinking-mode",
        choices=["enabled", "disabled", "adaptive"],
        default=None,
        help="with the chat template: whether the model reasons before it answers (default: the "
        "template's own)",
    )
    _dense_window(p)
    _speculative(p)


def _compile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        dest="cpu_compile",
        nargs="?",
        const="wait",
        choices=("auto", "wait", "off"),
        help="on the CPU, run each decode step as one compiled program kept on disk (about 5x the "
        "decode speed of op by op at batch 1). auto (the default, or $M3LM_CPU_COMPILE): use it "
        "if built, else build it in the background (about a minute, once per model shape) while "
        "this run decodes op by op; wait (--compile alone): wait for it; off: op by op",
    )


def _pool_flags(p: argparse.ArgumentParser, utilization: float | None, default: str) -> None:
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=utilization,
        metavar="F",
        help="share of the whole GPU's memory for weights, activations and the KV cache; the cache "
        f"takes what is left after the weights and the measured peak activation (default: {default})",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="the KV cache's size in bytes, or e.g. 20GiB, 512MiB (default: from --gpu-memory-utilization)",
    )
    size.add_argument(
        "--kv-cache-tokens",
        type=_positive,
        default=None,
        metavar="N",
        help="the KV cache's size in tokens (default: from --gpu-memory-utilization)",
    )


def _shared_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs the model: parallelism, weights, tokenizer."""
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive,
        default=1,
        metavar="N",
        help="shard the model over N processes (GPUs) of this node; under torchrun, its ranks",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with tensor parallelism: whole experts per rank instead of every expert's width split",
    )
    p.add_argument(
        "--quant",
        choices=["auto", "keep", "mxfp8", "none"],
        default="auto",
        help="quantised weights: auto keeps a checkpoint's MXFP8 and 4-bit weights as stored on a GPU "
        "(dequantised on the CPU), keep does so on any device, mxfp8 holds every weight in 8 bits "
        "(quantising at load), none dequantises",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="auto reads the safetensors; dummy builds random weights on the device from config.json "
        "alone (a folder with only config.json works), for benchmarks",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: token ids in and out (serve's completions take token-id prompts)",
    )
    p.add_argument(
        "--verbose", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )


def _command(sub, name: str, summary: str, examples: list[str], func) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog="example" + ("s" if len(examples) > 1 else "") + ":\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=HelpFormatter,
    )
    p.set_defaults(func=func)
    return p


def build_parser(commands) -> argparse.ArgumentParser:
    """The parser; `commands` maps each command's name to the function that runs it."""
    parser = argparse.ArgumentParser(
        prog="m3lm",
        description="Run MiniMax-M3 models on a GPU or the CPU: generate, chat, serve an OpenAI-"
        "compatible API.\nWithout --model, the embedded 10M-parameter story model runs.",
        epilog="examples:\n"
        '  m3lm generate --prompt "Once upon a time"\n'
        "  m3lm chat --model DIR\n"
        "  m3lm serve --model DIR --api-key KEY\n"
        "m3lm COMMAND --help tells more.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    _command(
        sub,
        "list",
        "List the supported model families and the default model.",
        ["m3lm list"],
        commands["list"],
    )

    gen = _command(
        sub,
        "generate",
        "Generate text from a prompt: the text on stdout, token counts and speed on stderr.",
        [
            'm3lm generate --prompt "Once upon a time" --max-tokens 64 --temperature 0',
            'm3lm generate --model DIR --chat --prompt "Hi" --thinking-mode enabled',
        ],
        commands["generate"],
    )
    _model_flag(gen)
    gen.add_argument(
        "--prompt", required=True, help="the text to continue (or, with --chat, the user's message)"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the chat template; reasoning, if any, goes to stderr apart from the answer",
    )
    _device_flags(gen)
    _sampling_flags(gen)

    chat = _command(
        sub,
        "chat",
        "Chat in the terminal; each turn computes only what it adds to the conversation.",
        ['m3lm chat --system "Be brief"', "m3lm chat --model DIR --thinking-mode disabled"],
        commands["chat"],
    )
    _model_flag(chat)
    _device_flags(chat)
    _sampling_flags(chat)
    chat.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        metavar="N",
        help="tokens the conversation may hold, prompts and replies (default: "
        f"{SESSION_CONTEXT}, at most the model's)",
    )

    srv = _command(
        sub,
        "serve",
        "Serve an OpenAI-compatible HTTP API: chat, completions, streaming, tools, reasoning.",
        ["m3lm serve --port 8000 --api-key KEY", "m3lm serve --model DIR --host 0.0.0.0 --api-key KEY"],
        commands["serve"],
    )
    _model_flag(srv)
    srv.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on; 0.0.0.0 for every interface"
    )
    srv.add_argument("--port", type=_port, default=8000, help="the port to listen on")
    srv.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="required Bearer token, or several separated by commas (default: M3LM_API_KEY, else none)",
    )
    srv.add_argument(
        "--cache-salt-by-api-key",
        action="store_true",
        help="share prefix-cache pages only among requests made with the same API key",
    )
    srv.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: the model directory's name; story for the "
        "embedded model)",
    )
    _device_flags(srv)
    srv.add_argument(
        "--max-num-seqs", type=_positive, default=64, metavar="N", help="requests running at once"
    )
    srv.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        metavar="N",
        help="tokens one request may hold, prompt and reply (default: what the KV cache holds, at "
        "most the model's)",
    )
    srv.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=2048,
        metavar="N",
        help="tokens one step computes at most; longer prompts are prefilled in chunks",
    )
    srv.add_argument(
        "--max-queue",
        type=_positive,
        default=256,
        metavar="N",
        help="waiting requests beyond which new ones get 503",
    )
    srv.add_argument(
        "--max-requests-per-key",
        type=_positive,
        default=None,
        metavar="N",
        help="with several API keys: requests (running and waiting, a choice each) one key may hold "
        "at once; more get 429 (default: half of --max-num-seqs plus --max-queue)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="on SIGTERM or Ctrl-C, seconds open requests may take to finish before their streams "
        "get an error event",
    )
    _dense_window(srv)
    _speculative(srv)
    srv.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="publish the prefix cache's pages stored and removed on ZeroMQ, as vLLM does, for "
        'prefix-aware routers: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"} (default: off)',
    )
    srv.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt whole (by default a prompt starts on the cached pages of its "
        "longest known prefix)",
    )
    srv.add_argument(
        "--engine-timeout",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds without a heartbeat from the engine process before it counts as stalled: "
        "/health answers 503 and open requests end with an error until it answers again",
    )
    srv.add_argument(
        "--no-web-ui",
        dest="web_ui",
        action="store_false",
        help="serve no chat page at / (by default / is a chat page that talks to this server)",
    )

    bn = _command(
        sub,
        "bench",
        "Time a slice of MiniMax-M3 with its real dimensions on an NVIDIA GPU against its floor.",
        [
            "m3lm bench --layers 4 --decode 1x4096,64x1024 --prefill 8192 --compare-transformers",
            "m3lm bench --layers 4 --decode 1x4096,16x2048 --verify 1x4096,16x2048 --drafter --iters 20",
        ],
        commands["bench"],
    )
    bn.add_argument("--layers", type=_positive, default=4, help="layers of the slice (layer 0 dense)")
    bn.add_argument(
        "--decode", default="1x4096,16x2048,64x1024,1x131072", help="decode cases, BATCHxCONTEXT,..."
    )
    bn.add_argument("--prefill", default="4096,8192", help="prefill lengths (batch 1)")
    bn.add_argument(
        "--attention", default="", help="MSA attention lengths to time against dense flash (default: none)"
    )
    bn.add_argument(
        "--verify",
        default="",
        help="speculative verification cases, BATCHxCONTEXT,..., each with the 60-layer projection "
        "against a decode case of the same batch and context (default: none)",
    )
    bn.add_argument(
        "--num-spec-tokens", type=_positive, default=3, metavar="K", help="draft tokens a verification checks"
    )
    bn.add_argument(
        "--drafter",
        nargs="?",
        const="64,4",
        default="",
        metavar="KV,...",
        help="time drafting for each --verify case with a random EAGLE-3 drafter at the published "
        "shapes, for each of these KV head counts (given alone: 64,4, the published drafter and its "
        "GQA variant; default: no drafter)",
    )
    bn.add_argument(
        "--acceptance",
        default="2.8,3.0",
        help="mean acceptance lengths of the 60-layer projection (the published ones at 3 draft tokens)",
    )
    bn.add_argument("--iters", type=_positive, default=20, help="timed calls per case")
    bn.add_argument(
        "--quant",
        default="bf16",
        help="weights: bf16, or one of mxfp8, nvfp4, mxfp4, affine4 (kept 8- or 4-bit), or bf16 and one of "
        "them (both, one process: bf16,nvfp4)",
    )
    bn.add_argument(
        "--compare-transformers",
        action="store_true",
        help="time transformers' implementation on the same slice",
    )
    bn.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the Markdown report to this file, and a plot of decode step time against context beside it (default: none)",
    )

    pl = _command(
        sub,
        "plan",
        "Tell what a checkpoint needs on each GPU: its resident weights and the KV cache left, from "
        "the file headers alone (nothing is loaded).",
        [
            "m3lm plan --model DIR --tensor-parallel-size 4 --gpu-memory 141GB",
            "m3lm plan --model DIR --tensor-parallel-size 8 --expert-parallel --gpu-memory 80GB",
        ],
        commands["plan"],
    )
    _model_flag(pl)
    pl.add_argument(
        "--tensor-parallel-size",
        type=_positive,
        default=1,
        metavar="N",
        help="the GPUs the model is sharded over",
    )
    pl.add_argument("--expert-parallel", action="store_true", help="whole experts per GPU (as serve's flag)")
    pl.add_argument(
        "--quant",
        choices=["auto", "keep", "mxfp8", "none"],
        default="auto",
        help="as serve's --quant, on a GPU",
    )
    pl.add_argument(
        "--gpu-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="one GPU's memory, e.g. 141GB, 80GB (default: the visible GPU's)",
    )
    pl.add_argument(
        "--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F", help="as serve's flag"
    )
    pl.add_argument(
        "--reserve",
        type=parse_size,
        default="8GB",
        metavar="SIZE",
        help="an allowance for activations, workspace and CUDA graphs; serve measures its own",
    )

    for p in (gen, chat, srv):
        _shared_flags(p)
    for p in (gen, chat):
        _pool_flags(p, None, "a cache of the request's length")
        _compile_flag(p)
    _pool_flags(srv, 0.9, "0.9")
    _compile_flag(srv)
    return parser
