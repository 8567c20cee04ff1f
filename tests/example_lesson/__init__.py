"""A small lesson kept outside the product: ``tests/test_example_lesson.py`` copies the tree, adds these three
modules as ``engine/lessons/example.py``, ``engine/run/example_counter.py`` (its word-counting worker and fault
phase) and ``app/lessons/example.py`` with one line in each registry, and checks that the lesson is everywhere a
lesson is (CLI, trace schema, worker and faults, tab, scene, screen audit, lifecycle)."""
