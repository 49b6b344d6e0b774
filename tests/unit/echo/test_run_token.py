"""A configured run token must be out of a guesser's reach (the learner accepted any length)."""

import pytest

from echo.config import ConfigError
from learner.config import check_token, load_learner_config


@pytest.mark.parametrize("token", ["hunter2", "a" * 40, "0123456789abcde"])
def test_a_weak_token_is_refused_with_what_to_do(token):
    with pytest.raises(ConfigError, match="at least 16 characters"):
        load_learner_config(None, ["--server.token", token])


def test_a_strong_or_empty_token_passes():
    assert load_learner_config(None, ["--server.token", "3f9a1c7e55b04d2a"]).server.token == "3f9a1c7e55b04d2a"
    assert load_learner_config(None, []).server.token == ""  # empty: a random one at start
    assert check_token("") == ""
