"""The `m3lm` command: list | generate | chat | serve | bench | plan (arguments in `cli_parser.py`)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from m3lm.errors import M3lmError
from m3lm.threads import quiet_waits

FAMILIES = [
    {
        "name": "MiniMax-M3",
        "model_type": "minimax_m3_vl, minimax_m3, minimax_m3_vl_text",
        "architecture": "MiniMaxM3SparseForConditionalGeneration (the text decoder)",
        "attention": "MSA: a lightning indexer picks top-k blocks per KV group",
        "experts": "MoE: sigmoid router with bias, and a shared expert",
        "weights": "bf16; MXFP8 kept in 8 bits on GPUs, also as tensor-parallel shards; MLX affine, "
        "NVFP4 and MXFP4 exports dequantised at load",
    },
]


def cmd_list(_: argparse.Namespace) -> int:
    """The families as blocks of `key  value` lines, each within 80 columns."""
    from m3lm.assets import DEFAULT_MODEL

    for family in FAMILIES:
        print(family["name"])
        for key in ("model_type", "architecture", "attention", "experts", "weights"):
            lines = textwrap.wrap(family[key], 80 - 16)
            print(f"  {key:<14}{lines[0]}")
            for more in lines[1:]:
                print(f"  {'':<14}{more}")
    print("\ndefault model (10M parameters, MSA + MoE, trained on short stories):")
    print(f"  {DEFAULT_MODEL}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Each GPU's weights and KV cache for a checkpoint, from its headers (`m3lm.memory_plan`)."""
    import torch

    from m3lm.memory_plan import describe, plan_memory

    gpu = args.gpu_memory
    if gpu is None:
        if not torch.cuda.is_available():
            raise M3lmError(
                "no GPU is visible here: say --gpu-memory SIZE (e.g. 141GB for an H200, 80GB for an H100)"
            )
        gpu = torch.cuda.get_device_properties(0).total_memory
    plan = plan_memory(
        args.model,
        args.tensor_parallel_size,
        gpu,
        expert_parallel=args.expert_parallel,
        quant=args.quant,
        utilization=args.gpu_memory_utilization,
        reserve_bytes=args.reserve,
    )
    print(describe(plan))
    return 0


def _load(args: argparse.Namespace):
    """(model, tokenizer, group or None); None on a follower rank under torchrun, which has
    already served rank 0's steps by the time it returns."""
    from m3lm.engine.launch import load_for_engine
    from m3lm.threads import use_threads

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr, leave=False)
        bar.update(done - bar.n)

    try:
        loaded = load_for_engine(load_spec(args), progress)
        if loaded is not None:
            use_threads(loaded[0], args.threads)
        return loaded
    finally:
        if bar is not None:
            bar.close()


def load_spec(args: argparse.Namespace):
    """The loading flags of `generate`, `chat` and `serve` as one LoadSpec."""
    from m3lm.config import LoadSpec

    return LoadSpec(
        args.model,
        device=args.device,
        dtype=args.dtype,
        quant=args.quant,
        load_format=args.load_format,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        expert_parallel=getattr(args, "expert_parallel", False),
        skip_tokenizer_init=args.skip_tokenizer_init,
    )


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


def _check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling settings before anything loads (unset ones are the checkpoint's)."""
    from m3lm.core import SamplingParams

    SamplingParams(**{k: v for k, v in _sampling(args).items() if v is not None})


def _stream(
    model, tokenizer, args: argparse.Namespace, engine=None, interrupt: bool = False, lead: str = "", **prompt
) -> str:
    """Stream one reply: the answer to stdout (after `lead`, written with the first token),
    reasoning (if the model reasons) to stderr apart from it, stats to stderr. Ctrl-C stops the reply after the current step (the request is
    aborted; the engine stays usable), and then, with `interrupt`, raises KeyboardInterrupt
    once the stats are out. Returns the answer's text."""
    import signal
    import threading
    import time

    from m3lm.generation import peak_memory_bytes, prompt_ids, stream_generate

    messages = prompt.pop("messages", None)
    if messages is not None:  # rendered here, so that the reply's reasoning can be told apart
        prompt["prompt"] = prompt_ids(
            tokenizer, None, messages, None, prompt.pop("chat_template_kwargs", None)
        )
    printer = ReplyPrinter.for_prompt(tokenizer, prompt["prompt"] if messages is not None else None)
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    start, first, n_prompt, n_gen, cached, accept = time.perf_counter(), None, 0, 0, 0, None
    compile_s = compiled = None  # the engine's compile seconds at the first chunk, and since
    chunks = stream_generate(
        model,
        tokenizer,
        msa_dense_window=args.msa_dense_window,
        engine=engine,
        pool=None if engine is not None else _pool(args),
        speculative_config=None if engine is not None else args.speculative_config,
        **prompt,
        **_sampling(args),
    )
    try:
        for chunk in chunks:
            first = first or time.perf_counter()
            if lead:
                sys.stdout.write(lead)
                lead = ""
            printer.add(chunk.token_ids, chunk.text)
            n_prompt, n_gen, cached = chunk.prompt_tokens, chunk.generation_tokens, chunk.cached_tokens
            accept = chunk.acceptance_length
            compile_s = chunk.compile_s if compile_s is None else compile_s  # an engine's total
            compiled = chunk.compile_s - compile_s
            if stop.is_set():
                break
    finally:
        chunks.close()  # aborts the request if it has not finished
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    end = time.perf_counter()
    printer.end()
    if stop.is_set():
        print("(stopped)", file=sys.stderr)
    first = first or end
    compiled = compiled or 0.0
    decoding = end - first - compiled  # a compile of the decode step is not decoding
    gen_tps = (n_gen - 1) / decoding if n_gen > 1 and decoding > 0 else 0.0
    mem = peak_memory_bytes(model.lm_head.weight.device) / 2**30
    reused = f" ({cached} cached)" if cached else ""
    spec = f" | mean acceptance length: {accept:.2f}" if accept is not None else ""
    spec += f" | compiling: {compiled:.1f} s" if compiled else ""
    print(
        f"prompt: {n_prompt} tokens{reused}, {(n_prompt - cached) / max(first - start, 1e-9):.1f} tok/s | "
        f"generation: {n_gen} tokens, {gen_tps:.1f} tok/s{spec} | peak memory: {mem:.2f} GiB",
        file=sys.stderr,
    )
    if interrupt and stop.is_set():
        raise KeyboardInterrupt
    return printer.answer()


class ReplyPrinter:
    """Writes a streamed reply: the answer to stdout; the reasoning of a model that reasons to
    stderr, between a "thinking" and an "answer" line, so that the two never run together (and
    `> file` keeps the answer alone)."""

    def __init__(self, parser=None):
        self.parser = parser  # a ReasoningParser, or None for a reply with no reasoning markers
        self.parts: list[str] = []
        self.thinking = False

    @classmethod
    def for_prompt(cls, tokenizer, ids) -> ReplyPrinter:
        if ids is None:
            return cls()
        from m3lm.text.reasoning import ReasoningParser, ReplyFormat, detect_thinking_mode

        try:
            markers = ReplyFormat.from_tokenizer(tokenizer.hf).reasoning
        except ValueError:  # a tokenizer without think markers: no reasoning to tell apart
            return cls()
        return cls(ReasoningParser(markers, detect_thinking_mode(ids, markers)))

    def add(self, token_ids: list[int], text: str) -> None:
        from m3lm.text.reasoning import Channel

        channel = Channel.CONTENT
        if self.parser is not None:
            routed = [self.parser.route(t) for t in token_ids] or [Channel.CONTENT]
            kept = [c for c in routed if c is not Channel.DROP]
            channel = kept[-1] if kept else Channel.DROP
            if self.parser.in_reasoning and not self.thinking:
                self.thinking = True
                print("thinking:", file=sys.stderr, flush=True)
        if channel is Channel.REASONING:
            sys.stderr.write(text)
            sys.stderr.flush()
            return
        if self.thinking and (text or not self.parser.in_reasoning):
            self.thinking = False
            print("\nanswer:", file=sys.stderr, flush=True)
        if channel is Channel.CONTENT:
            self.parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()

    def end(self) -> None:
        if self.thinking:  # stdout stays empty: say why
            sys.stderr.write("\n")
            print(
                "m3lm: the reply ended in its reasoning, before an answer (raise --max-tokens, or "
                "--thinking-mode disabled)",
                file=sys.stderr,
            )
        sys.stdout.write("\n")
        sys.stdout.flush()

    def answer(self) -> str:
        return "".join(self.parts)


def _need_tokenizer(args: argparse.Namespace) -> None:
    if args.skip_tokenizer_init:
        raise M3lmError(
            f"m3lm {args.command} reads and prints text, so it needs a tokenizer: drop "
            "--skip-tokenizer-init (token ids in and out: m3lm serve, or the Python API)"
        )


def cmd_generate(args: argparse.Namespace) -> int:
    _need_tokenizer(args)
    _check_sampling(args)
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
        kwargs = _template_kwargs(args)
        _stream(model, tokenizer, args, interrupt=True, messages=messages, chat_template_kwargs=kwargs)
    else:
        # A text completion continues the prompt: the whole text is printed, once the prompt is taken.
        _stream(model, tokenizer, args, interrupt=True, lead=args.prompt, prompt=args.prompt)


def cmd_chat(args: argparse.Namespace) -> int:
    """A REPL that keeps the conversation (`chat_repl.py`)."""
    _need_tokenizer(args)
    _check_sampling(args)
    loaded = _load(args)
    if loaded is None:  # a follower rank under torchrun: rank 0 has finished
        return 0
    model, tokenizer, group = loaded
    try:
        from m3lm.chat_repl import run_chat

        return run_chat(model, tokenizer, args, _stream, _pool(args))
    finally:
        if group is not None:
            group.shutdown()


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may be reachable from elsewhere
        return False


def _api_keys(value: str | None) -> list[str] | None:
    """The keys of `--api-key KEY1,KEY2` (empty entries dropped), or None for no key."""
    keys = [k.strip() for k in (value or "").split(",") if k.strip()]
    return keys or None


def serve_settings(args: argparse.Namespace) -> dict:
    """`m3lm serve`'s flags as `server.app.serve`'s arguments, less the host and the port (also
    what each Ray Serve replica starts from: `serve_ray.py`)."""
    from m3lm.server.protocol import Limits

    _default_model(args)
    keys = _api_keys(args.api_key or os.environ.get("M3LM_API_KEY"))
    if args.cache_salt_by_api_key and not keys:
        raise M3lmError("--cache-salt-by-api-key needs --api-key (or M3LM_API_KEY)")
    return dict(
        load=load_spec(args),
        api_key=keys,
        cache_salt_by_api_key=args.cache_salt_by_api_key,
        served_model_name=args.served_model_name,
        limits=Limits(
            max_queue=args.max_queue,
            max_requests_per_key=args.max_requests_per_key,
            engine_timeout_s=args.engine_timeout,
        ),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        msa_dense_window=args.msa_dense_window,
        prefix_caching=args.prefix_caching,
        speculative_config=args.speculative_config,
        kv_events_config=args.kv_events_config,
        threads=args.threads,
        grace_s=args.drain_timeout,
        web_ui=args.web_ui,
        **_pool(args),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from m3lm.server.app import serve

    settings = serve_settings(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings["api_key"] and not _loopback(args.host):
        logging.getLogger("m3lm.server").warning(
            "--host %s without --api-key: anyone who can reach this machine can use the server; "
            "set --api-key (or M3LM_API_KEY)",
            args.host,
        )
    serve(host=args.host, port=args.port, **settings)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    _bench_flags(args)
    import torch

    if not torch.cuda.is_available():
        raise M3lmError("m3lm bench needs an NVIDIA GPU")
    from m3lm.bench.plot import decode_series, line_plot
    from m3lm.bench.report import markdown
    from m3lm.bench.run import run

    rows, notes = run(args)
    report = markdown(rows, "m3lm " + " ".join(sys.argv[1:]), notes)
    print(report)
    if args.out:
        out = Path(args.out)
        out.write_text("# m3lm bench: a slice of MiniMax-M3 at the release's dimensions\n\n" + report)
        series = decode_series([(r.case, r.ms) for r in rows])
        line_plot(
            out.with_suffix(".png"),
            "Decode step time against context",
            "context (tokens)",
            "ms per step",
            series,
            logx=True,
        )
    return 0


def _bench_flags(args: argparse.Namespace) -> None:
    """The bench's lists from their comma-separated flags, checked."""

    def numbers(flag: str, kind, pairs: bool = False) -> list:
        text = getattr(args, flag)
        try:
            return [
                tuple(kind(x) for x in item.lower().split("x", 1)) if pairs else kind(item)
                for item in text.split(",")
                if item
            ]
        except ValueError:
            form = "BATCHxCONTEXT,..." if pairs else f"{kind.__name__},..."
            raise M3lmError(f"--{flag} {text}: expected {form}") from None

    args.decode, args.verify = numbers("decode", int, True), numbers("verify", int, True)
    args.prefill, args.attention = numbers("prefill", int), numbers("attention", int)
    args.drafter, args.acceptance = numbers("drafter", int), numbers("acceptance", float)
    args.quant = [q for q in args.quant.split(",") if q]
    k = args.num_spec_tokens
    if args.drafter and not args.verify:
        raise M3lmError("--drafter times drafting for the --verify cases: give --verify too")
    if any(not 1 <= a <= k + 1 for a in args.acceptance):
        raise M3lmError(
            f"--acceptance {','.join(f'{a:g}' for a in args.acceptance)}: a mean acceptance length "
            f"is between 1 and k + 1 = {k + 1} (--num-spec-tokens {k})"
        )
    if any(kv < 1 or 64 % kv for kv in args.drafter):  # the release's 64 attention heads
        raise M3lmError(f"--drafter {','.join(map(str, args.drafter))}: KV head counts must divide 64")
    if any(len(c) != 2 or min(c) < 1 for c in args.decode + args.verify):
        raise M3lmError("--decode and --verify cases are BATCHxCONTEXT with both at least 1")


def _pool(args: argparse.Namespace) -> dict:
    """The KV pool's EngineConfig fields given on the command line, and `cpu_compile` when set."""
    keys = ("gpu_memory_utilization", "kv_cache_memory", "kv_cache_tokens")
    fields = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    mode = getattr(args, "cpu_compile", None)
    return fields | ({"cpu_compile": mode} if mode is not None else {})


def _default_model(args: argparse.Namespace) -> None:
    if getattr(args, "model", "") is None:
        from m3lm.assets import DEFAULT_MODEL

        args.model = str(DEFAULT_MODEL)


def version() -> str:
    """The installed distribution's version; the package's own when run from a plain source tree."""
    from importlib import metadata

    try:
        return metadata.version("m3lm")
    except metadata.PackageNotFoundError:
        from m3lm.version import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from m3lm import cli_parser

    commands = {
        "list": cmd_list,
        "generate": cmd_generate,
        "chat": cmd_chat,
        "serve": cmd_serve,
        "bench": cmd_bench,
        "plan": cmd_plan,
    }
    return cli_parser.build_parser(commands)


def _refuse_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A mistyped flag is refused under its command's usage, with the flag it likely meant,
    before argparse would complain of something else (a required flag it took for missing)."""
    import difflib

    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    at = next((i for i, tok in enumerate(argv) if not tok.startswith("-")), None)
    if at is None or argv[at] not in commands:
        return
    sub = commands[argv[at]]
    known = list(sub._option_string_actions)
    for tok in argv[at + 1 :]:
        if tok == "--":
            return
        flag = tok.split("=", 1)[0]
        if flag.startswith("--") and not any(k.startswith(flag) for k in known):
            close = difflib.get_close_matches(flag, known, n=1)
            sub.error(f"unrecognized argument: {flag}" + (f" (did you mean {close[0]}?)" if close else ""))


def main(argv: list[str] | None = None) -> int:
    quiet_waits()  # before anything imports torch
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    _refuse_unknown_flags(parser, argv)
    args = parser.parse_args(argv)
    if args.version:
        print(f"m3lm {version()}")
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    _default_model(args)
    try:
        return args.func(args)
    except (M3lmError, OSError, ValueError) as e:
        if args.verbose:
            raise
        print(f"m3lm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nm3lm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from m3lm.server.lifecycle import Stopped

        if not isinstance(e, Stopped):
            raise
        print(f"m3lm: {e}", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
