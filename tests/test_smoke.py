import copc
from copc.cli import main


def test_version_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == copc.__version__
