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
    from m3lm.generation import session_engine

    _check_chat(model, tokenizer, args)
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
        line = _read_line(interactive)
        if line is None:
            return 0
        name = command(line)
        if name is not None:
            if not _obey(name, history):
                return 0
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


def _check_chat(model, tokenizer, args) -> None:
    """M3lmError when there is no chat template to talk through; a warning when --max-model-len
    asks for more positions than the model has."""
    from m3lm.errors import M3lmError

    if tokenizer is None or not tokenizer.has_chat_template:
        raise M3lmError(f"{args.model} has no tokenizer with a chat template")
    most = model.args.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > most:
        print(
            f"m3lm: --max-model-len {args.max_model_len} is above the model's {most} positions "
            f"(max_position_embeddings in config.json): the conversation holds {most} tokens",
            file=sys.stderr,
        )


def _read_line(interactive: bool) -> str | None:
    """The next line, typed or piped in, without its newline; None at the end of the input
    (Ctrl-D); "" after Ctrl-C at the prompt, which only starts a fresh line, as a shell does."""
    try:
        line = input(">> ") if interactive else sys.stdin.readline()
    except EOFError:
        print(file=sys.stderr)
        return None
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return ""
    if not interactive and not line:
        return None
    return line.rstrip("\n")


def _obey(name: str, history: list[dict]) -> bool:
    """Carry out command `name` (an unknown one is refused); False when it is /exit."""
    if name == "/exit":
        return False
    if name == "/reset":
        history.clear()
        print("(the conversation is forgotten)", file=sys.stderr)
    elif name == "/help":
        print(HELP, file=sys.stderr)
    else:
        print(f"unknown command {name}; /help lists them (// sends a leading /)", file=sys.stderr)
    return True
