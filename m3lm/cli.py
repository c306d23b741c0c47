"""The `m3lm` command line: list | generate | chat."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

from m3lm.errors import M3lmError

FAMILIES = [
    {
        "model_type": "minimax_m3_vl / minimax_m3 / minimax_m3_vl_text",
        "architecture": "MiniMaxM3SparseForConditionalGeneration (text decoder)",
        "msa": "yes (lightning indexer, per-KV-group top-k blocks)",
        "moe": "yes (sigmoid router + bias, shared expert)",
        "quantized": "mxfp8 (kept 8-bit on GPUs, also as tensor-parallel shards)",
    },
]


def cmd_list(_: argparse.Namespace) -> int:
    from m3lm import DEFAULT_MODEL

    cols = ["model_type", "architecture", "msa", "moe", "quantized"]
    heads = {c: c.upper() for c in cols}
    widths = {c: max(len(heads[c]), *(len(f[c]) for f in FAMILIES)) for c in cols}
    print("  ".join(heads[c].ljust(widths[c]) for c in cols).rstrip())
    for f in FAMILIES:
        print("  ".join(f[c].ljust(widths[c]) for c in cols).rstrip())
    print(f"\ndefault model: {DEFAULT_MODEL} (10M-parameter story model, MSA + MoE)")
    return 0


def cpu_threads(requested: int | None, device_type: str, cpu_count: int | None) -> int | None:
    """Threads for torch's CPU kernels, or None to leave torch alone (off the CPU).

    The default is a few threads, not one per core: decode is bound by memory bandwidth, which a
    few threads already use up, and on a busy machine every extra thread waits on the slowest."""
    if device_type != "cpu":
        return None
    return requested if requested is not None else min(4, cpu_count or 1)


def _load(args: argparse.Namespace):
    """(model, tokenizer, group or None); None on a follower rank under torchrun, which has
    already served rank 0's steps by the time it returns."""
    import m3lm
    from m3lm.distributed.launch import launch, under_torchrun

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr, leave=False)
        bar.update(done - bar.n)

    from m3lm.loader import resolve_device

    threads = cpu_threads(args.threads, resolve_device(args.device).type, os.cpu_count())
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    tp = getattr(args, "tensor_parallel_size", 1)
    try:
        if tp > 1 or under_torchrun():
            if args.load_format != "auto" or args.skip_tokenizer_init:
                raise M3lmError("--load-format dummy and --skip-tokenizer-init need --tensor-parallel-size 1")
            ep = args.expert_parallel
            return launch(
                args.model, tp, ep, device=args.device, dtype=args.dtype, progress=progress, quant=args.quant
            )
        loaded = m3lm.load(
            args.model,
            device=args.device,
            dtype=args.dtype,
            progress=progress,
            quant=args.quant,
            load_format=args.load_format,
            skip_tokenizer_init=args.skip_tokenizer_init,
        )
        return (*loaded, None)
    finally:
        if bar is not None:
            bar.close()


def _sampling(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos or None,
    }


def _template_kwargs(args: argparse.Namespace) -> dict:
    return {"thinking_mode": args.thinking_mode} if args.thinking_mode else {}


def _stream(model, tokenizer, args: argparse.Namespace, engine=None, **prompt) -> str:
    """Stream one reply to stdout; return its text. Stats go to stderr."""
    from m3lm.generate import peak_memory_bytes, stream_generate

    start, first, text, n_prompt, n_gen, cached = time.perf_counter(), None, [], 0, 0, 0
    for chunk in stream_generate(
        model,
        tokenizer,
        msa_dense_window=args.msa_dense_window,
        engine=engine,
        pool=None if engine is not None else _pool(args),
        **prompt,
        **_sampling(args),
    ):
        first = first or time.perf_counter()
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        text.append(chunk.text)
        n_prompt, n_gen, cached = chunk.prompt_tokens, chunk.generation_tokens, chunk.cached_tokens
    end = time.perf_counter()
    sys.stdout.write("\n")
    first = first or end
    gen_tps = (n_gen - 1) / (end - first) if n_gen > 1 and end > first else 0.0
    mem = peak_memory_bytes(model.lm_head.weight.device) / 2**30
    reused = f" ({cached} cached)" if cached else ""
    print(
        f"prompt: {n_prompt} tokens{reused}, {(n_prompt - cached) / max(first - start, 1e-9):.1f} tok/s | "
        f"generation: {n_gen} tokens, {gen_tps:.1f} tok/s | peak memory: {mem:.2f} GiB",
        file=sys.stderr,
    )
    return "".join(text)


def _need_tokenizer(args: argparse.Namespace) -> None:
    if args.skip_tokenizer_init:
        raise M3lmError(
            f"m3lm {args.command} reads and prints text, so it needs a tokenizer: drop "
            "--skip-tokenizer-init (token ids in and out: m3lm serve, or the Python API)"
        )


def cmd_generate(args: argparse.Namespace) -> int:
    _need_tokenizer(args)
    loaded = _load(args)
    if loaded is None:
        return 0
    model, tokenizer, group = loaded
    try:
        _generate(model, tokenizer, args)
    except RuntimeError:
        if group is not None and (why := group.dead_worker()):
            raise M3lmError(why) from None
        raise
    finally:
        if group is not None:
            group.shutdown()
    return 0


def _generate(model, tokenizer, args: argparse.Namespace) -> None:
    if tokenizer is None:
        raise M3lmError(f"{args.model} has no tokenizer files: m3lm generate needs one")
    if args.chat or args.system:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        _stream(model, tokenizer, args, messages=messages, chat_template_kwargs=_template_kwargs(args))
    else:
        sys.stdout.write(args.prompt)  # a text completion continues the prompt: print the whole text
        _stream(model, tokenizer, args, prompt=args.prompt)


def cmd_chat(args: argparse.Namespace) -> int:
    """A REPL that keeps the conversation; /reset clears it, /exit or end of input quits."""
    _need_tokenizer(args)
    loaded = _load(args)
    if loaded is None:  # a follower rank under torchrun: rank 0 has finished
        return 0
    model, tokenizer, group = loaded
    try:
        return _chat(model, tokenizer, args)
    finally:
        if group is not None:
            group.shutdown()


def _chat(model, tokenizer, args: argparse.Namespace) -> int:
    from m3lm.generate import session_engine

    if tokenizer is None or not tokenizer.has_chat_template:
        raise M3lmError(f"{args.model} has no tokenizer with a chat template")
    # One engine for the whole conversation: each turn's prompt starts on the pages that the
    # history left in its prefix cache, so only the new message (and the template's tail) is
    # computed.
    engine = session_engine(model, tokenizer, args.max_model_len, args.msa_dense_window, pool=_pool(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(">> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        line = line.rstrip("\n")
        if line.strip() == "/reset":
            history = []
            print("(history cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _stream(
                model,
                tokenizer,
                args,
                engine,
                messages=system + history,
                chat_template_kwargs=_template_kwargs(args),
            )
        except ValueError as exc:  # the conversation outgrew the context: the turn is dropped
            history.pop()
            print(f"error: {exc}; /reset starts a new conversation", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})


def _api_keys(value: str | None) -> list[str] | None:
    """The keys of `--api-key KEY1,KEY2` (empty entries dropped), or None for no key."""
    keys = [k.strip() for k in (value or "").split(",") if k.strip()]
    return keys or None


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from m3lm.server.app import serve
    from m3lm.server.protocol import Limits

    keys = _api_keys(args.api_key or os.environ.get("M3LM_API_KEY"))
    if args.cache_salt_by_api_key and not keys:
        raise M3lmError("--cache-salt-by-api-key needs --api-key (or M3LM_API_KEY)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=keys,
        cache_salt_by_api_key=args.cache_salt_by_api_key,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        limits=Limits(max_queue=args.max_queue, engine_timeout_s=args.engine_timeout),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        msa_dense_window=args.msa_dense_window,
        prefix_caching=args.prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        quant=args.quant,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
        **_pool(args),
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise M3lmError("m3lm bench needs an NVIDIA GPU")
    from m3lm import bench

    args.decode = [tuple(int(x) for x in item.lower().split("x")) for item in args.decode.split(",") if item]
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    args.attention = [int(x) for x in args.attention.split(",") if x]
    args.quant = [q for q in args.quant.split(",") if q]
    rows, notes = bench.run(args)
    report = bench.markdown(rows, "m3lm " + " ".join(sys.argv[1:]), notes)
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    return 0


def _positive(text: str) -> int:
    n = int(text)
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


def _pool_args(p: argparse.ArgumentParser, utilization: float | None, default: str) -> None:
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=utilization,
        metavar="F",
        help="share of the whole GPU's memory for weights, activations and the KV cache; the cache "
        f"takes what is left after the weights and the measured peak activation ({default})",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="the KV cache's size in bytes, or e.g. 20GiB, 512MiB (instead of --gpu-memory-utilization)",
    )
    size.add_argument(
        "--kv-cache-tokens", type=_positive, default=None, metavar="N", help="the KV cache's size in tokens"
    )


def _pool(args: argparse.Namespace) -> dict:
    """The KV pool's EngineConfig fields given on the command line."""
    keys = ("gpu_memory_utilization", "kv_cache_memory", "kv_cache_tokens")
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded story model)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        metavar="N",
        help="CPU threads for torch on the CPU (default: min(4, cores)); ignored on a GPU",
    )
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--thinking-mode", choices=["enabled", "disabled", "adaptive"], default=None)
    p.add_argument(
        "--msa-dense-window",
        type=float,
        default=None,
        metavar="F",
        help="approximation, off by default: attend densely while the selected window covers >= 1/F of the context",
    )


def _default_model(args: argparse.Namespace) -> None:
    if getattr(args, "model", "") is None:
        from m3lm import DEFAULT_MODEL

        args.model = str(DEFAULT_MODEL)


def version() -> str:
    """The installed distribution's version; the package's own when run from a plain source tree."""
    from importlib import metadata

    try:
        return metadata.version("m3lm")
    except metadata.PackageNotFoundError:
        import m3lm

        return getattr(m3lm, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    from m3lm.generate import SESSION_CONTEXT

    parser = argparse.ArgumentParser(prog="m3lm", description="Run MiniMax-M3 models.")
    parser.add_argument("--version", action="version", version=f"m3lm {version()}")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the supported model families").set_defaults(func=cmd_list)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    _model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat that keeps history")
    _model_args(chat)
    chat.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"tokens the conversation may hold, prompt and reply (default: {SESSION_CONTEXT}, at most the model's)",
    )
    chat.set_defaults(func=cmd_chat)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--model", default=None, help="checkpoint directory (default: the embedded story model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        default=None,
        help="required Bearer token, or several separated by commas (or set M3LM_API_KEY)",
    )
    srv.add_argument(
        "--cache-salt-by-api-key",
        action="store_true",
        help="share prefix-cache pages only among requests made with the same API key",
    )
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--device", default=None)
    srv.add_argument("--dtype", default=None)
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--max-num-batched-tokens", type=int, default=2048)
    srv.add_argument(
        "--max-queue", type=int, default=256, help="waiting requests beyond which new ones get 503"
    )
    srv.add_argument(
        "--engine-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds without a heartbeat from the engine process before it counts as stalled: "
        "/health answers 503 and open requests end with an error until it answers again",
    )
    srv.add_argument("--msa-dense-window", type=float, default=None, metavar="F")
    srv.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt whole (by default a prompt starts on the cached pages of its longest known prefix)",
    )
    srv.set_defaults(func=cmd_serve)
    bn = sub.add_parser("bench", help="time a real-dimension slice on the GPU against its floor")
    bn.add_argument("--layers", type=int, default=4)
    bn.add_argument("--decode", default="1x4096,16x2048,64x1024,1x131072", help="BxCTX,... decode cases")
    bn.add_argument("--prefill", default="4096,8192", help="prefill lengths (batch 1)")
    bn.add_argument("--attention", default="", help="MSA attention lengths to time against dense flash")
    bn.add_argument("--iters", type=int, default=20)
    bn.add_argument(
        "--quant", default="bf16", help="weights: bf16, mxfp8 (kept 8-bit) or bf16,mxfp8 (both, one process)"
    )
    bn.add_argument("--compare-transformers", action="store_true")
    bn.add_argument("--out", default=None, help="append the Markdown report to this file")
    bn.set_defaults(func=cmd_bench)
    for p in (gen, chat, srv):
        p.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help="shard the model over N processes (GPUs) of this node; under torchrun, its ranks",
        )
        p.add_argument(
            "--expert-parallel",
            action="store_true",
            help="with tensor parallelism: whole experts per rank instead of every expert's width split",
        )
    for p in (gen, chat):
        _pool_args(p, None, "default: a cache of the request's length")
    _pool_args(srv, 0.9, "default: 0.9")
    for p in (gen, chat, srv):
        p.add_argument(
            "--quant",
            choices=["auto", "mxfp8", "none"],
            default="auto",
            help="MXFP8 weights: auto keeps an MXFP8 checkpoint in 8 bits on a GPU, mxfp8 always "
            "(quantising a bf16 checkpoint at load), none dequantises",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _default_model(args)
    try:
        return args.func(args)
    except (M3lmError, OSError, ValueError) as e:
        if args.verbose:
            raise
        print(f"m3lm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
