"""The window's plain models: what a run, an experiment and the view hold, read by every view and written only by
the link's routing. No Qt here (a contract keeps it out): each is tested, and could be driven, without a window."""
