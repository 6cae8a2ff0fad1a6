"""The built-in environments (served by default; more with --env-classes module:Class)."""

from env_server.base import Environment
from env_server.builtins.calculator import Calculator
from env_server.builtins.retry import Retry

BUILTIN: tuple[type[Environment], ...] = (Calculator, Retry)
