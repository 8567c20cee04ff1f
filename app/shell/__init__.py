"""The main window and what surrounds it: menus, file actions, dock arrangement, dialogs, remembered settings, the
self-test and the X11 watch."""
