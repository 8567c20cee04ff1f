"""One panel per file. Each has ``refresh(store)`` (called by the window's ~30 fps timer when the store
changed) and ``set_theme(theme)``; none of them touches torch."""
