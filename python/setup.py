"""The wheel carries a prebuilt library (attnkit/lib/libattnkit_ops.so), so it is tagged for
this platform and Python, not as pure Python; pyproject.toml holds the rest."""
from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution)
