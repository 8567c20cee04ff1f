"""Lecture mode: the scenes, the course and lecture files, and rendering a scene to video."""
