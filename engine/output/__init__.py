"""What a run leaves behind: the trace file (written and read through one schema) and the Perfetto export."""
