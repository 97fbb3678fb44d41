"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), for Claude Code and
agents built on the `anthropic` SDK.

- schemas: the request bodies (content blocks, tools, tool_choice, thinking);
- prompt: a request as the chat completion that generates its reply (the chat planner, its
  tools and constraints), and the chat's parameter names spelled back as Anthropic's;
- output: the reply as a message or as Anthropic's stream of events;
- routes: the routes, `x-api-key` auth, and `MessagesFront`, this room's side of admission.

Errors take Anthropic's shape on these routes (gateway/errors.py).
"""
