"""``flashreinforce serve``: an OpenAI-compatible endpoint over a trained run or any model ``--model`` takes.

``flashreinforce serve RUN_OR_MODEL [--host H] [--port P] [--model_name NAME] [--tool_parser NAME]
[--temperature T] [--top_p P] [--top_k K] [--max_tokens N] [--max_len N] [--api_key KEY] [--device D]
[--torch_threads N]``

``RUN_OR_MODEL`` is what ``--model`` takes: a run directory (its newest checkpoint; the adapters of a
LoRA run merged into its base), its ``hf`` export or ``hf/adapter`` folder (base and adapter), a
Hugging Face folder, a ``.gguf`` file or an alias. Calls are rendered and their tool calls parsed
as during training (:mod:`flashreinforce.agents.serving`), and sampled by the project's own engine
with the run's settings as defaults: ``rollout.temperature``, ``rollout.top_p``, ``rollout.top_k``,
``rollout.max_new_tokens`` (``max_tokens``), ``data.max_len``, and, for an agent run, its
``tool_parser`` and ``model_name`` (a flag given here wins). Clients send the API key
(``--api_key``, ``$FLASHREINFORCE_SERVE_API_KEY``, else a random one); the endpoint has the training
endpoint's limits. Serves until Ctrl-C or SIGTERM; one line on stderr gives the ``base_url`` (and a
random key). Exit status 0, or 2 for a model or option that cannot be served.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

__all__ = ["API_KEY_ENV", "serve", "start_endpoint"]

#: The API key clients must send, when ``--api_key`` is not given (else a random one is printed).
API_KEY_ENV = "FLASHREINFORCE_SERVE_API_KEY"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashreinforce serve", description=(
            "Serve a trained run (or any model --model takes) on an OpenAI-compatible endpoint "
            "(/v1/chat/completions, /v1/completions, /v1/models), with the chat rendering and the tool-call "
            "parsing of training. Sampling defaults to the run's settings."))
    p.add_argument("model", help="a run directory, its hf export or hf/adapter folder, a Hugging Face folder, a "
                                 ".gguf file or an alias")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                       "only; every call needs the API key)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--model_name", help="the name /v1/models lists (default: the run's, else 'policy'; any name is "
                                        "accepted in requests)")
    p.add_argument("--tool_parser", help="how tool calls are read from the model's text (default: the run's, "
                                         "else hermes)")
    p.add_argument("--temperature", type=float, help="default sampling temperature (default: the run's "
                                                     "rollout.temperature, else 1.0)")
    p.add_argument("--top_p", type=float, help="default top-p (default: the run's rollout.top_p, else 1.0)")
    p.add_argument("--top_k", type=int, help="top-k for every call (default: the run's rollout.top_k, else 0: off)")
    p.add_argument("--max_tokens", type=int, help="default new tokens per call (default: the run's "
                                                  "rollout.max_new_tokens, else 512)")
    p.add_argument("--max_len", type=int, help="prompt and answer tokens at most (default: the run's data.max_len, "
                                               "else the model's maximum position)")
    p.add_argument("--api_key", help="the API key clients must send (default: $FLASHREINFORCE_SERVE_API_KEY, else a "
                                     "random one, printed at the start)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--torch_threads", type=int, help="PyTorch intra-op threads (default: PyTorch's)")
    return p


def _run_config(spec: str):
    """The run's resolved configuration when ``spec`` is a run directory (or a path inside one), else None."""
    from flashreinforce.api import load_config

    path = Path(spec)
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / "config.yaml").is_file() and (candidate / "config.json").is_file():
            try:
                return load_config(candidate / "config.yaml")
            except Exception:  # a run of another version: serve with the plain defaults
                return None
    return None


def serve_settings(args: dict[str, Any], model_config: Any = None):
    """The :class:`~flashreinforce.agents.serving.ServeSettings` of a command line: flags, then the run's
    settings, then plain defaults."""
    from flashreinforce.agents.serving import ServeSettings

    cfg = _run_config(args["model"])
    run: dict[str, Any] = {}
    if cfg is not None:
        run = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k,
               "max_tokens": cfg.rollout.max_new_tokens, "max_len": cfg.data.max_len}
        for key in ("tool_parser", "model_name"):
            if isinstance(cfg.env_kwargs.get(key), str):
                run[key] = cfg.env_kwargs[key]
    positions = getattr(model_config, "max_position_embeddings", None)
    if "max_len" not in run and isinstance(positions, int):
        run["max_len"] = positions
    values = {**run, **{k: args[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "max_len", "tool_parser",
                                             "model_name") if args.get(k) is not None}}
    return ServeSettings(**values)


def start_endpoint(args: dict[str, Any]):
    """Load the model of ``args`` (the command's options as a dict) and start its endpoint; returns it
    (``.url`` is its ``base_url``; ``.stop()`` ends it)."""
    import torch

    from flashreinforce.agents.serving import Sample, ServeEndpoint
    from flashreinforce.config import ConfigError
    from flashreinforce.engines import GenerationRequest, SamplingParams, create_engine
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer

    if args.get("torch_threads"):
        torch.set_num_threads(int(args["torch_threads"]))
    device = torch.device(args.get("device") or "cpu")
    model, tok_spec = build_model(args["model"], device=device)
    model.eval()
    tokenizer = load_tokenizer(tok_spec)
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(f"{args['model']}: serving needs a Hugging Face tokenizer (this model's is {tok_spec!r})")
    settings = serve_settings(args, model.config)
    engine = create_engine("hf", model, pad_token_id=tokenizer.pad_token_id, version=0)
    lock = threading.Lock()

    def sample(requests, temperature, top_p, top_k):
        params = SamplingParams(temperature, top_p, top_k, tokenizer.eos_token_ids)
        batch = [GenerationRequest(r.prompt_ids, r.max_tokens, r.seed,
                                   stop=(lambda ids, s=r.stop: any(x in tokenizer.decode(ids) for x in s)) if r.stop
                                   else None) for r in requests]
        with lock:
            out = engine.generate(batch, params)
        return [Sample(list(g.token_ids), list(g.log_probs), g.finish_reason) for g in out]

    try:
        endpoint = ServeEndpoint(tokenizer.tok, tokenizer.eos_token_ids, tokenizer.decode, sample, settings,
                                 host=args.get("host") or "127.0.0.1", port=int(args.get("port", 8000)),
                                 api_key=args.get("api_key") or os.environ.get(API_KEY_ENV) or None)
    except ValueError as err:  # an unknown tool parser
        raise ConfigError(f"--tool_parser: {err}") from None
    endpoint.start()
    return endpoint


def serve(argv: Sequence[str]) -> int:
    from flashreinforce.config import ConfigError

    args = vars(_parser().parse_args(argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        from flashreinforce.agents.server import require_server_packages

        require_server_packages()
    except ImportError as err:
        print(f"flashreinforce serve: error: {err}", file=sys.stderr)
        return 2
    print(f"flashreinforce serve: loading {args['model']} ...", file=sys.stderr, flush=True)
    try:
        endpoint = start_endpoint(args)
    except (ConfigError, OSError) as err:
        print(f"flashreinforce serve: error: {err}", file=sys.stderr)
        return 2
    s = endpoint.settings
    key = "the API key given" if args.get("api_key") or os.environ.get(API_KEY_ENV) else f"API key {endpoint.api_key}"
    print(f"flashreinforce serve: {args['model']} at {endpoint.url} ({key}; model name {s.model_name!r}; "
          f"defaults {json.dumps({k: getattr(s, k) for k in ('temperature', 'top_p', 'top_k', 'max_tokens', 'max_len')})}, "
          f"tool parser {s.tool_parser}); Ctrl-C stops", file=sys.stderr, flush=True)
    done = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        endpoint.stop()
    print(f"flashreinforce serve: stopped after {endpoint.served} answers", file=sys.stderr)
    return 0
