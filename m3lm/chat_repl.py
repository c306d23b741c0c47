"""`m3lm chat`: a conversation in the terminal.

In a terminal the prompt has line editing and history (readline), and a long paste arrives
whole (readline reads the line itself, past the terminal's 4 KiB line limit). Lines that start
with / are commands; an unknown one is refused, never sent to the model (// sends a leading /).
Ctrl-C during a reply stops it and keeps the conversation; at the prompt it clears the line;
Ctrl-D (or the end of the input) leaves.
"""

from __future__ import annotations

import sys
from pathlib import Path

COMMANDS = {
    "/help": "show this help",
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "leave (Ctrl-D does too)",
}
HELP = "\n".join(
    [f"  {name:<8}{what}" for name, what in COMMANDS.items()]
    + ["  //text   send a message that starts with /", "Ctrl-C stops a reply and keeps the conversation."]
)


def command(line: str) -> str | None:
    """The command a line gives (`/name`), or None for a message."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    return text.split()[0]


def run_chat(model, tokenizer, args, stream, pool: dict) -> int:
    """The REPL; `stream(model, tokenizer, args, engine, messages=..., chat_template_kwargs=...)`
    prints one reply and returns its answer."""
    from m3lm.errors import M3lmError
    from m3lm.generation import session_engine

    if tokenizer is None or not tokenizer.has_chat_template:
        raise M3lmError(f"{args.model} has no tokenizer with a chat template")
    most = model.args.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > most:
        print(
            f"m3lm: --max-model-len {args.max_model_len} is above the model's {most} positions "
            f"(max_position_embeddings in config.json): the conversation holds {most} tokens",
            file=sys.stderr,
        )
    # One engine for the whole conversation: each turn's prompt starts on the pages that the
    # history left in its prefix cache, so only the new message (and the template's tail) is computed.
    engine = session_engine(
        model,
        tokenizer,
        args.max_model_len,
        args.msa_dense_window,
        pool=pool,
        speculative_config=args.speculative_config,
    )
    system = [{"role": "system", "content": args.system}] if args.system else []
    template = {"thinking_mode": args.thinking_mode} if args.thinking_mode else {}
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 (input() edits lines and keeps history once it is loaded)

        device = next(model.parameters()).device
        print(
            f"m3lm chat with {Path(args.model).name} on {device}. /help lists the commands; "
            "Ctrl-C stops a reply; Ctrl-D leaves.",
            file=sys.stderr,
        )
    while True:
        try:
            line = input(">> ") if interactive else sys.stdin.readline()
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print(file=sys.stderr)
            continue
        if not interactive and not line:
            return 0
        line = line.rstrip("\n")
        name = command(line)
        if name == "/exit":
            return 0
        if name == "/reset":
            history = []
            print("(the conversation is forgotten)", file=sys.stderr)
            continue
        if name == "/help":
            print(HELP, file=sys.stderr)
            continue
        if name is not None:
            print(f"unknown command {name}; /help lists them (// sends a leading /)", file=sys.stderr)
            continue
        if line.lstrip().startswith("//"):
            line = line.lstrip()[1:]
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = stream(
                model, tokenizer, args, engine, messages=system + history, chat_template_kwargs=template
            )
        except ValueError as exc:  # the conversation outgrew the context: the turn is dropped
            history.pop()
            print(f"error: {exc}; /reset starts a new conversation", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
