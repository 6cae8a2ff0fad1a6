"""python -m mesh ...: the same as the `dapo-mesh` command."""

from mesh.cli import app

if __name__ == "__main__":
    app()
