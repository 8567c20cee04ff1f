"""A small lesson kept outside the product: ``tests/engine/test_example_lesson.py`` copies the tree, adds these two
modules as ``engine/lessons/example.py`` and ``app/lessons/example.py`` with one line in each registry, and checks
that the lesson is everywhere a lesson is (CLI, trace schema, tab, scene, screen audit, lifecycle)."""
