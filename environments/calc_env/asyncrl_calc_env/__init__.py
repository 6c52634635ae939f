"""asyncrl's example environment server: the HiddenSum game over the
environment protocol (see :mod:`asyncrl_calc_env.server`)."""

from asyncrl_calc_env.server import (
    DEFAULT_MAX_EPISODES,
    DEFAULT_MAX_QUERIES,
    LOOKUP_TOOL,
    BadRequest,
    CalcEnvServer,
    HiddenSumGame,
)

__all__ = [
    "DEFAULT_MAX_EPISODES",
    "DEFAULT_MAX_QUERIES",
    "LOOKUP_TOOL",
    "BadRequest",
    "CalcEnvServer",
    "HiddenSumGame",
]
