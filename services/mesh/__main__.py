"""python -m services.mesh ...: the same as the `dapo-mesh` command."""

from services.mesh.cli import app

if __name__ == "__main__":
    app()
