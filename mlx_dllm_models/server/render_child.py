"""Renders one client-supplied chat template, as a separate process (templates.py runs this file
by its path, with the standard library and jinja2 only): a JSON job on stdin, a JSON answer on
stdout. The parent kills it at its deadline; the memory and output bounds are its own."""

import json
import resource
import sys
from datetime import datetime


def _limit_memory(nbytes: int) -> None:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    except (ValueError, OSError):  # a platform without the limit: the parent's deadline holds
        pass


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    # As transformers renders chat templates: a sandbox, its helpers and filters.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(job: dict) -> dict:
    from jinja2.exceptions import TemplateError

    limit = job["max_chars"]
    try:
        template = _environment().from_string(job["template"])
        pieces, size = [], 0
        for piece in template.generate(messages=job["messages"], **job["args"]):
            size += len(piece)
            if size > limit:
                return {"error": "size"}
            pieces.append(piece)
    except TemplateError as e:
        return {"error": "template", "message": str(e)}
    except MemoryError:
        return {"error": "memory"}
    except Exception as e:
        return {"error": "failed", "message": f"{type(e).__name__}: {e}"}
    return {"text": "".join(pieces)}


def main() -> None:
    job = json.loads(sys.stdin.read())
    _limit_memory(job["max_bytes"])
    sys.stdout.write(json.dumps(render(job)))


if __name__ == "__main__":
    main()
