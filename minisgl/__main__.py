"""`python -m minisgl [flags]`: the same as `./serve [flags]`."""

from minisgl.server.launch import run

if __name__ == "__main__":
    run()
