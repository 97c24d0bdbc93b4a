"""`serve --shell`: chat with the served model in the terminal, over the server's own HTTP API.

Replies stream as they are generated. The conversation is kept and sent with every turn; commands:
/reset (forget the conversation), /temperature X, /help, /exit (or Ctrl-D). Ctrl-C while a reply
streams stops that reply (the server aborts the request); at the prompt it leaves the shell.
Standard library only (urllib), so the shell works wherever the server does.
"""

from __future__ import annotations

import importlib
import json
import sys
import urllib.error
import urllib.request
from typing import Callable, Dict, Generator, List, Optional

from minisgl.server.tls import loopback_open

HELP = ("commands: /reset clears the conversation, /temperature X sets the sampling "
        "temperature, /exit quits (or Ctrl-D)")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stream_chat(url: str, model: str, messages: List[Dict[str, str]], temperature: float,
                timeout_s: float = 600.0) -> Generator[str, None, None]:
    """Yield the reply's text deltas. Raises RuntimeError with the server's message on an error.
    Closing the generator early closes the connection, which aborts the request."""
    body = json.dumps({"model": model, "messages": messages, "stream": True,
                       "temperature": temperature}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        resp = loopback_open(req, timeout_s)
    except urllib.error.HTTPError as e:
        detail = json.loads(e.read() or b"{}").get("error", {}).get("message", e.reason)
        raise RuntimeError(f"HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise RuntimeError(f"cannot reach the server: {e.reason}") from None
    with resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            for choice in json.loads(data).get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text


class Shell:
    def __init__(self, url: str, model: str, write: Callable[[str], None] = _write_stdout,
                 temperature: float = 0.0) -> None:
        self.url, self.model, self.write = url, model, write
        self.temperature = temperature
        self.history: List[Dict[str, str]] = []

    def command(self, line: str) -> Optional[bool]:
        """Handle a /command; True to quit, False if handled, None if `line` is no command."""
        if not line.startswith("/"):
            return None
        cmd, _, arg = line.partition(" ")
        if cmd in ("/exit", "/quit"):
            return True
        if cmd == "/reset":
            self.history.clear()
            self.write("(conversation cleared)\n")
        elif cmd == "/temperature":
            try:
                self.temperature = max(0.0, float(arg))
                self.write(f"(temperature {self.temperature})\n")
            except ValueError:
                self.write("usage: /temperature 0.7\n")
        else:
            self.write(HELP + "\n")
        return False

    def turn(self, text: str) -> None:
        """Send one user message and stream the answer; the turn is kept only if it completed."""
        self.history.append({"role": "user", "content": text})
        parts: List[str] = []
        replies = stream_chat(self.url, self.model, self.history, self.temperature)
        try:
            for delta in replies:
                parts.append(delta)
                self.write(delta)
        except KeyboardInterrupt:
            replies.close()
            self.history.pop()
            self.write("\n(interrupted)\n")
            return
        except RuntimeError as e:
            self.history.pop()
            self.write(f"error: {e}\n")
            return
        self.write("\n")
        self.history.append({"role": "assistant", "content": "".join(parts)})


def run_shell(url: str, model: str, read: Callable[[str], str] = input,
              write: Callable[[str], None] = _write_stdout) -> None:
    """The read-eval loop; returns on /exit, end of input, or Ctrl-C at the prompt."""
    try:
        importlib.import_module("readline")  # line editing and input history for input()
    except ImportError:  # pragma: no cover
        pass
    shell = Shell(url, model, write)
    write(f"chatting with {model} at {url}; {HELP}\n")
    while True:
        try:
            line = read(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        if not line:
            continue
        if shell.command(line):
            return
        if not line.startswith("/"):
            shell.turn(line)
