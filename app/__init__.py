"""KVScope's window. Draws engine events; never imports torch (the worker imports the engine lazily)."""
