"""The public API at zcvae/__init__.py: every name resolves, and importing zcvae stays light."""

import subprocess
import sys

import zcvae


def test_every_public_name_resolves_to_its_home():
    for name in zcvae.__all__:
        value = getattr(zcvae, name)
        assert value is not None, name
    assert zcvae.ZCVAE.__module__ == "zcvae.model.cvae"
    assert zcvae.collate.__module__ == "zcvae.data.encoding"


def test_unknown_names_raise_attribute_error():
    try:
        zcvae.no_such_name
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("zcvae.no_such_name resolved")


def test_importing_zcvae_or_its_data_package_does_not_import_torch():
    code = "import sys, zcvae, zcvae.data; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
