"""What KVScope knows and says, with no torch: the events, their bounds and checks, the formulas, a run's tally and
report, and what a config alone says."""
