"""The project's scripts: the scaled layout (scaled.py) and the generated settings tables."""
