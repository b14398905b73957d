"""Algorithms from outside the package, chosen from the shell: ``--algorithm package.module:Class``
and installed plugins found through the ``fedkernels.algorithms`` entry-point group.

A plugin is "installed" the cheap way that still goes through real entry-point discovery
(importlib.metadata): a ``*.dist-info`` folder with ``entry_points.txt`` next to the module, on
the child's PYTHONPATH, exactly what pip leaves in site-packages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_process import FAST, assert_one_line_error, assert_success, fedkernels

from fedkernels.algorithms.registry import strategy_class
from fedkernels.sim.config import ConfigError

PLUGIN_MODULE = '''
from dataclasses import dataclass, field

import torch

from fedkernels.sim.strategy import Strategy


@dataclass
class LossWeightedConfig:
    temperature: float = field(default=1.0, metadata={"help": "softmax temperature of the losses"})


class LossWeighted(Strategy):
    """Clients with a higher loss of the global model get more weight."""

    name = "loss_weighted"
    config_class = LossWeightedConfig
    wants_global_loss = True

    def client_weights(self, info):
        return torch.softmax(self.config.temperature * info.global_losses, 0)
'''


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory) -> Path:
    """A folder holding the module ``lw_plugin`` and the metadata of its distribution, with one
    good entry point and one whose module does not exist."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "lw_plugin").mkdir()
    (root / "lw_plugin" / "__init__.py").write_text(PLUGIN_MODULE)
    info = root / "lw_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lw-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fedkernels.algorithms]\n"
        "loss_weighted = lw_plugin:LossWeighted\n"
        "half_written = lw_missing_module:Strategy\n"
    )
    return root


@pytest.mark.slow
def test_installed_plugin_runs_from_the_shell(tmp_path, plugin_root):
    out = tmp_path / "run"
    done = fedkernels(
        "run", "--algorithm", "loss_weighted", "--loss_weighted.temperature", "2",
        "--rounds", "1", "--out", str(out), *FAST, PYTHONPATH=str(plugin_root),
    )
    assert_success(done)
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["algorithm"] == "loss_weighted"
    assert results["config"]["algorithm_params"] == {"temperature": 2.0}
    # the plugin's wants_global_loss took effect: the loop measured the losses it weights by
    assert "global_loss_before" in results["rounds"][0]


@pytest.mark.slow
def test_plugin_options_are_in_its_help_and_a_broken_plugin_is_one_line(plugin_root):
    done = fedkernels("run", "--algorithm", "loss_weighted", "--help", PYTHONPATH=str(plugin_root))
    assert_success(done)
    assert "--loss_weighted.temperature" in done.stdout and "softmax temperature" in done.stdout
    assert "half_written" in done.stdout  # listed among the algorithms, not imported

    done = fedkernels("run", "--algorithm", "half_written", "--rounds", "1",
                      PYTHONPATH=str(plugin_root))
    assert_one_line_error(
        done, "algorithm plugin 'half_written'", "lw_missing_module:Strategy", "lw-plugin",
        "failed to import", "No module named 'lw_missing_module'",
    )


@pytest.mark.slow
def test_import_path_from_the_current_folder_runs_and_resumes(tmp_path, plugin_root):
    out = tmp_path / "run"
    args = ["--algorithm", "lw_plugin:LossWeighted", "--loss_weighted.temperature", "3",
            "--out", str(out), *FAST]
    assert_success(fedkernels("run", "--rounds", "1", *args, cwd=plugin_root))
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == "lw_plugin:LossWeighted"  # so --resume can import it again
    done = fedkernels("run", "--resume", "--rounds", "2", "--out", str(out), *FAST,
                      cwd=plugin_root)
    assert_success(done)
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert results["config"]["algorithm_params"] == {"temperature": 3.0}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:Thing", "module no_such_module_xyz failed to import: ModuleNotFoundError"),
        ("json:dumps", "is dumps, not a subclass of fedkernels.sim.Strategy"),
        ("json:NoSuchThing", "json has no attribute 'NoSuchThing'"),
        ("json:", "expected package.module:Class"),
    ],
)
def test_bad_import_paths_are_clear(spec, message):
    with pytest.raises(ConfigError, match=message):
        strategy_class(spec)
