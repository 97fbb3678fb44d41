"""OpenAI's Responses API (routes.py) and Conversations (conversations.py): request items
(items.py), output items (output.py), a response's place in its session (chain.py) and the
stored records (store.py).
"""
