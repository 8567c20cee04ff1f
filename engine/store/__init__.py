"""Files KVScope keeps: where they live, written atomically, sealed so only this user's KVScope's files are read back,
and the per-machine measurements."""
