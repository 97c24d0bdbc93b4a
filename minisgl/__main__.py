"""`python -m minisgl [flags]`: the same as `./serve [flags]`."""

if __name__ == "__main__":  # spawned children re-import this module: they must import nothing
    from minisgl.server.launch import run

    run()
