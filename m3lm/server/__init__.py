"""OpenAI-compatible serving: request protocol, app, and the reply parsers (reasoning, tool calls)."""
