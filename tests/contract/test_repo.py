"""The repository keeps its promises: CI runs exactly the README's test command, and every public
name the README shows exists."""
import pathlib
import re

import effattn

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    test_cmd = ci[-1].strip()
    assert "pytest" in test_cmd
    assert test_cmd in _readme_commands(), f"README.md does not give CI's test command: {test_cmd}"
    assert any(line.startswith("python3 -m pip install -q torch==2.13.0") for line in ci)


def test_readme_names_exist():
    text = (ROOT / "README.md").read_text()
    for name in set(re.findall(r"(?<![\w.])effattn\.([A-Za-z_]\w*)\(", text)):
        assert hasattr(effattn, name), f"README uses effattn.{name}, which does not exist"
    for mod, name in set(re.findall(r"effattn\.(layouts|nn)\.([A-Za-z_]\w*)", text)):
        assert hasattr(getattr(effattn, mod), name), f"README uses effattn.{mod}.{name}, which does not exist"


def _python_blocks(section: str):
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_readme_api_examples_run():
    """The README's softmax and linear attention examples run as written (shorter sequences)."""
    code = "\n".join(_python_blocks("Softmax attention") + _python_blocks("Linear attention"))
    assert "effattn.attention(" in code and "effattn.linear_attention(" in code
    code = code.replace("4096", "1024").replace("2048", "512").replace("3000", "800")
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 1024, 64)
    assert namespace["out2"].shape == (2, 8, 512, 64)         # the second segment of the state example
    assert namespace["layout"].density() < 1.0


def test_readme_model_examples_run(capsys):
    """The README's swap_attention, effattn.nn and KV-cache examples run as written (shorter
    sequences); the Hugging Face one needs a downloaded model and is left out."""
    blocks = [b for b in _python_blocks("Swap it into your model") if "from_pretrained" not in b]
    code = "\n".join(blocks)
    assert "swap_attention(" in code and "KVCache()" in code and "range(x.shape[1])" in code
    namespace = {}
    exec(compile(code.replace("4096", "64"), "README.md", "exec"), namespace)
    assert namespace["y"].shape == (4, 64, 512)
    assert isinstance(namespace["model"], effattn.nn.TransformerEncoder)    # the KV-cache example's model
    assert namespace["h"].shape == (1, 1, 512)
    printed = capsys.readouterr().out
    assert "layers.0.self_attn: torch.nn.MultiheadAttention(512, 8, batch_first=True) -> " in printed
