"""What the panels and scenes are drawn with: charts and their theme, a lesson's tab shell, the status strip, the
frame clock, export, and the screen audit that reads all of it back."""
