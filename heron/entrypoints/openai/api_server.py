"""``python -m heron.entrypoints.openai.api_server --model MODEL [flags]``, as vLLM's entrypoint."""

from heron.server.cli import main

if __name__ == "__main__":
    main(prog="python -m heron.entrypoints.openai.api_server")
