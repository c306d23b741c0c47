"""The command line as a new user meets it: help, defaults, examples, `list`, reasoning apart
from the answer, and `m3lm chat` in a real terminal (a pseudo-terminal: line editing, history,
a long paste, Ctrl-C)."""

import argparse
import os
import re
import select
import subprocess
import sys
import time

import pytest

import m3lm
from m3lm.cli import build_parser, main
from m3lm.cli_parser import HelpFormatter
from m3lm.tokenizer import load_tokenizer
from tests.support.cli import cli
from tests.support.paths import PATIENCE_S


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_m3lm_alone_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: m3lm") and "generate" in out and "m3lm COMMAND --help" in out


def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    for name, sub in {"m3lm": parser, **subcommands(parser)}.items():
        formatter = HelpFormatter(name)
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {action.option_strings[0]}"
            assert action.help, f"{flag} has no help"
            if action.required or isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
                continue  # required, or a switch: off unless given
            assert "default" in formatter._get_help_string(action), f"{flag} does not show its default"


def test_each_command_has_a_one_line_description_and_an_example():
    for name, sub in subcommands(build_parser()).items():
        assert sub.description and "\n" not in sub.description, name
        examples = sub.epilog.split("\n")
        assert examples[0] in ("example:", "examples:"), name
        assert all(e.startswith(f"  m3lm {name}") for e in examples[1:]), (name, examples)


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["serve", "--help"], ["chat", "--help"], ["list"]]
)
def test_help_version_and_list_answer_without_importing_torch(argv):
    code = (
        "import sys\nfrom m3lm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "False", r.stdout


def test_list_fits_80_columns(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].strip() == str(m3lm.DEFAULT_MODEL)  # a path is as long as the folder it is in
    assert all(len(line) <= 80 for line in lines[:-1]), [line for line in lines if len(line) > 80]


def test_generate_shows_reasoning_apart_from_the_answer():
    """With thinking enabled the prompt opens the reasoning; the embedded model never closes it,
    so its whole reply is reasoning: on stderr after "thinking:", none of it on stdout. With
    thinking disabled the same words are the answer, on stdout."""
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")
    args = [
        "generate",
        "--chat",
        "--prompt",
        "Tell me about a cat",
        "--max-tokens",
        "24",
        "--temperature",
        "0",
    ]
    for mode in ("enabled", "disabled"):
        want = m3lm.generate(
            model,
            tok,
            messages=[{"role": "user", "content": "Tell me about a cat"}],
            chat_template_kwargs={"thinking_mode": mode},
            max_tokens=24,
            temperature=0.0,
        ).text
        r = cli(*args, "--thinking-mode", mode)
        assert r.returncode == 0, r.stderr
        if mode == "enabled":
            assert r.stdout == "\n" and f"thinking:\n{want}\n" in r.stderr
            assert "m3lm: the reply ended in its reasoning, before an answer" in r.stderr  # why none
        else:
            assert r.stdout == want + "\n" and "thinking:" not in r.stderr


def test_the_reply_printer_puts_reasoning_and_answer_apart(capsys):
    from m3lm.cli import ReplyPrinter
    from m3lm.text.reasoning import ReasoningMarkers, ReasoningParser, ThinkingMode

    printer = ReplyPrinter(ReasoningParser(ReasoningMarkers(start_id=1, end_id=2), ThinkingMode.ENABLED))
    for ids, text in (([10], "Let me"), ([11], " think."), ([2], ""), ([12], "A cat"), ([13], " purrs.")):
        printer.add(ids, text)
    printer.end()
    out, err = capsys.readouterr()
    assert out == "A cat purrs.\n" and printer.answer() == "A cat purrs."
    assert err == "thinking:\nLet me think.\nanswer:\n"  # no word of a missing answer


def test_chat_commands_are_never_sent_to_the_model():
    r = cli("chat", "--max-tokens", "4", "--temperature", "0", stdin="/help\n/nope\n//hello\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "/reset" in r.stderr and "unknown command /nope; /help lists them" in r.stderr
    assert r.stderr.count("prompt: ") == 1  # only "/hello" (sent with //) reached the model


class Terminal:
    """`m3lm chat` in a pseudo-terminal: what a person types, what they see."""

    def __init__(self, *args: str):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal is its stdin, stdout and stderr
            os.execve(
                sys.executable, [sys.executable, "-m", "m3lm", "chat", *args], {**os.environ, "TERM": "dumb"}
            )
        self.seen = ""

    def read_until(self, pattern: str, start: int = 0) -> int:
        """Read until `pattern` appears after position `start` of what was seen; its end."""
        deadline = time.monotonic() + PATIENCE_S
        while (m := re.compile(pattern).search(self.seen, start)) is None:
            assert time.monotonic() < deadline, f"waited for {pattern!r}: {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.fd], [], [], 1.0)
            if ready:
                try:
                    self.seen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child has exited
                    assert m, f"the chat ended before {pattern!r}: {self.seen[-2000:]!r}"
        return m.end()

    def type(self, text: str) -> None:
        data = text.encode()
        while data:  # a long paste goes in pieces, as a terminal delivers it
            n = os.write(self.fd, data[:1024])
            data = data[n:]

    def close(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_chat_in_a_terminal_pastes_whole_keeps_history_and_survives_ctrl_c():
    tok = load_tokenizer(m3lm.DEFAULT_MODEL)
    paste = " ".join(["the little dog ran to the park"] * 200)  # 6,199 bytes: past a terminal's 4 KiB line
    want_tokens = len(tok.chat_prompt([{"role": "user", "content": paste}], None, True))
    term = Terminal("--max-tokens", "8", "--temperature", "0")
    try:
        at = term.read_until(r"m3lm chat with story on cpu\. /help lists the commands")
        at = term.read_until(r">> ", at)
        term.type(paste + "\r")
        at = term.read_until(rf"prompt: {want_tokens} tokens", at)  # the whole paste reached the model
        at = term.read_until(r">> ", at)
        term.type("/reset\r")
        at = term.read_until(r"forgotten[\s\S]*>> ", at)
        term.type("Tell me a story about a cat.\r")
        at = term.read_until(r"prompt: \d+ tokens", at)
        at = term.read_until(r">> ", at)
        term.type("\x1b[A")  # the up arrow brings the last line back (readline's history)
        at = term.read_until(r"Tell me a story about a cat\.", at)
        term.type("\r")
        at = term.read_until(r"prompt: \d+ tokens \(\d+ cached\)", at)  # the conversation goes on
        at = term.read_until(r">> ", at)
        term.type("/exit\r")
    finally:
        code = term.close()
    assert code == 0
    assert "Traceback" not in term.seen


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_ctrl_c_in_chat_stops_the_reply_and_keeps_the_conversation():
    term = Terminal("--max-tokens", "1500", "--ignore-eos", "--temperature", "0")
    try:
        at = term.read_until(r">> ")
        term.type("Tell me a long story.\r")
        at = term.read_until(r"Tell me a long story\.\r?\n.{20}", at)  # the reply has begun
        term.type("\x03")
        at = term.read_until(r"\(stopped\)", at)
        stats = term.read_until(r"generation: \d+ tokens", at)
        generated = int(re.findall(r"generation: (\d+) tokens", term.seen[at:stats])[-1])
        assert generated < 1500
        at = term.read_until(r">> ", stats)
        term.type("And then?\r")
        at = term.read_until(r"prompt: \d+ tokens \(\d+ cached\)", at)  # the stopped turn is history
        at = term.read_until(r">> ", at)
        term.type("\x04")  # Ctrl-D leaves
    finally:
        code = term.close()
    assert code == 0 and "Traceback" not in term.seen
