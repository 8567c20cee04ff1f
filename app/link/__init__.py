"""The window's link to the engine: the worker thread that runs it, the routing of its events into the state, and
the controller that turns a user's action into a request."""
