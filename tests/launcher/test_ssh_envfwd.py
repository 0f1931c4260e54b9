"""launcher.envfwd: which variables reach remote workers, env-file parsing and its errors (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import envfwd
from launcher.errors import LaunchError


def test_forwarded_names_follow_the_documented_rules() -> None:
    yes = ["NCCL_DEBUG", "PYTHONPATH", "UCX_TLS", "MLFLOW_TRACKING_URI", "CUDA_DEVICE_MAX_CONNECTIONS",
           "TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME", "FI_PROVIDER", "HF_HOME", "WANDB_PROJECT",
           "OMP_NUM_THREADS", "DS_ACCELERATOR", "DSLAUNCH_OFFLOAD_GRAD_TRANSFER"]  # fmt: skip
    no = ["PATH", "LD_LIBRARY_PATH", "HOME", "SSH_AUTH_SOCK", "CUDA_VISIBLE_DEVICES", "CUDA_HOME",
          "RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "MY_VAR", "DSLAUNCH_ATTEMPT"]  # fmt: skip
    assert [n for n in yes if not envfwd.is_forwarded(n)] == []
    assert [n for n in no if envfwd.is_forwarded(n)] == []


def test_env_files_layer_over_the_environment_and_name_their_source(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "proj"
    home.mkdir(), cwd.mkdir()
    (home / ".dslaunch_env").write_text("A=home\nB=home\n")
    (cwd / ".dslaunch_env").write_text(
        "# comment\n\n"
        "export B=cwd\n"
        "C='spaces and \"quotes\" and $HOME # not a comment'\n"
        'D="x\'y"\n'
        "E=plain value # a comment\n"
        "NCCL_DEBUG=WARN\n"
    )
    env = {"NCCL_DEBUG": "INFO", "PATH": "/bin", "PYTHONFAULTHANDLER": "1"}
    fwd = envfwd.collect(env, cwd, home)
    assert dict(fwd.values) == {
        "NCCL_DEBUG": "WARN",  # the file beats the environment
        "PYTHONFAULTHANDLER": "1",
        "A": "home",
        "B": "cwd",  # the working directory's file beats home's
        "C": 'spaces and "quotes" and $HOME # not a comment',
        "D": "x'y",
        "E": "plain value",
    }
    assert fwd.sources["PYTHONFAULTHANDLER"] == "environment"
    assert fwd.sources["B"] == f"{cwd / '.dslaunch_env'}:3"
    # The summary names variables, never values (they may be secrets).
    text = fwd.describe()
    assert "NCCL_DEBUG" in text and "WARN" not in text and str(home / ".dslaunch_env") in text


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("JUSTANAME", "expected NAME=VALUE"),
        ("1BAD=x", "'1BAD' is not a valid variable name"),
        ("RANK=3", "RANK is set by dslaunch"),
        ("Q='unclosed", "No closing quotation"),
        ("Q='a' 'b'", "one word"),
    ],
)
def test_env_file_errors_name_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    f = tmp_path / ".dslaunch_env"
    f.write_text(f"OK=1\n# fine\n{line}\n")
    with pytest.raises(LaunchError) as info:
        envfwd.collect({}, tmp_path, tmp_path / "nohome")
    assert str(info.value).startswith(f"{f}:3: ")
    assert reason in str(info.value)
