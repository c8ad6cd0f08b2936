"""Jinja rendering of the ``templates/*.cu.jinja`` binding files of one kernel configuration."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from .env import JitError, TemplateNotFoundError, templates_dir


@functools.lru_cache(maxsize=8)
def _environment(directory: str) -> jinja2.Environment:
    # StrictUndefined: a template that reads a name the context lacks is a bug to report at render
    # time, not an empty string that nvcc may or may not trip over later.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(directory),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def output_name(template: str) -> str:
    """``"attention_nvfp4.cu.jinja" -> "attention_nvfp4.cu"``."""
    return template[: -len(".jinja")] if template.endswith(".jinja") else template


def render_template(
    template: str, context: Mapping[str, Any], template_dir: Path | None = None
) -> str:
    directory = Path(template_dir) if template_dir is not None else templates_dir()
    env = _environment(str(directory))
    try:
        return env.get_template(template).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise TemplateNotFoundError(
            f"kernel template {exc.name!r} not found in {directory}"
        ) from None
    except jinja2.UndefinedError as exc:
        raise JitError(
            f"template {template!r} uses a name the render context lacks ({exc.message}); "
            f"the context has: {', '.join(sorted(context))}"
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise JitError(
            f"template {template!r} has a Jinja syntax error at line {exc.lineno}: {exc.message}"
        ) from None


def render_templates(
    templates: tuple[str, ...], context: Mapping[str, Any], template_dir: Path | None = None
) -> dict[str, str]:
    """Render every template with the same context; ``{output file name: text}`` in order.

    A missing template raises :class:`TemplateNotFoundError` naming all the files the
    configuration needs, so a half-installed package is easy to diagnose.
    """
    directory = Path(template_dir) if template_dir is not None else templates_dir()
    missing = [t for t in templates if not (directory / t).is_file()]
    if missing:
        raise TemplateNotFoundError(
            f"kernel template(s) {', '.join(missing)} not found in {directory} "
            f"(op {context.get('op')!r} needs {', '.join(templates)})"
        )
    return {output_name(t): render_template(t, context, directory) for t in templates}
