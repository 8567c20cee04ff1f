"""Benchmarks: run by ``make bench`` (never by ``make test``). Each prints a table and saves JSON in
``bench-results/``; README quotes figures only from these outputs, with the machine they ran on."""
