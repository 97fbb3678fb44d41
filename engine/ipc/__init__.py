"""How the engine core is reached: in a thread of the caller's process (async_engine.py) or in
its own process (core_process.py) through `EngineProcess` (core_client.py) over `CoreLink`
(core_link.py), with the messages of wire.py. sinks.py is the event loop's side of both
clients; parent_watch.py ends a child process with its parent.
"""
