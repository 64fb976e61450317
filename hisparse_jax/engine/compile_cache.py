"""Start once per machine: jax's persistent compilation cache, on by default for the engine.

`enable()` points jax's persistent compilation cache at a directory, so a process that
compiles what an earlier one compiled (same program, same jax, same device) reads the
executable back instead of compiling it again. The `Engine` calls it when
`EngineConfig.compilation_cache` is True (the default).

Which directory (the first that applies):
  1. `enable(directory)`'s argument, when given;
  2. the environment variable `HISPARSE_JAX_COMPILATION_CACHE`: "0", "off" or "false" (any
     case) turns the engine's cache off (`enable()` returns None and changes nothing);
     any other non-empty value is the directory;
  3. a directory already configured for jax (`JAX_COMPILATION_CACHE_DIR` /
     `jax_compilation_cache_dir`), kept as it is;
  4. `$XDG_CACHE_HOME/hisparse_jax/jax`, or `~/.cache/hisparse_jax/jax`.

Every executable is cached whatever its compile time (the engine's many small bucketed
helpers compile in well under jax's default threshold of one second), unless the environment
sets `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` itself.

The cache is trusted: a directory others can write lets them run code in this process (jax's
own warning); the default directory is the user's own.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV_VAR = "HISPARSE_JAX_COMPILATION_CACHE"
_OFF = frozenset({"0", "off", "false"})


def default_directory() -> str:
    """`$XDG_CACHE_HOME/hisparse_jax/jax`, or `~/.cache/hisparse_jax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hisparse_jax", "jax")


def enable(directory: str | os.PathLike[str] | None = None) -> str | None:
    """Turns on jax's persistent compilation cache (directory rules: module docstring).

    Args:
      directory: the cache directory (created if missing); None: the environment variable,
        then a directory jax already has, then `default_directory()`.
    Returns:
      The directory in use, or None when the environment variable turns the cache off (or
      jax's `jax_enable_compilation_cache` is False).
    """
    if directory is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if env.lower() in _OFF:
            return None
        directory = env or jax.config.jax_compilation_cache_dir or default_directory()
    if not jax.config.jax_enable_compilation_cache:
        return None
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    os.makedirs(directory, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != directory:
        if jax.config.jax_compilation_cache_dir is not None:
            compilation_cache.reset_cache()  # the next compile opens the new directory
        compilation_cache.set_cache_dir(directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def disable() -> None:
    """Turns jax's persistent compilation cache off again (no directory); e.g. after a test
    that enabled it on a temporary directory."""
    if jax.config.jax_compilation_cache_dir is not None:
        compilation_cache.reset_cache()
        compilation_cache.set_cache_dir(None)
