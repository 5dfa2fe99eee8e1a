"""Package mapping: the folders cluster/, replica/, kernels/ become ditserve.cluster, ditserve.replica,
ditserve.kernels (generic top-level names would clash with other distributions, e.g. PyPI's `kernels`).

The three roots have no ``__init__.py``: they are namespace portions, so with the repository root on
``sys.path`` (``python -m pytest`` from the root, Ray workers started from the checkout) an installed
regular package of the same name still wins. Their subfolders are regular packages."""

from setuptools import find_packages, setup

ROOTS = ("cluster", "replica", "kernels")
packages = []
for root in ROOTS:
    packages.append(f"ditserve.{root}")
    packages += [f"ditserve.{root}.{sub}" for sub in find_packages(root)]

setup(
    packages=packages,
    package_dir={f"ditserve.{root}": root for root in ROOTS},
    package_data={
        "": ["*.json", "*.txt", "*.md", "*.safetensors", "*.proto", "*.yaml"],
        # the trained demo models' folders are data, not packages
        "ditserve.replica.models": [
            f"{d}/{glob}" for d in ("demo_scenes", "demo_scenes_video") for glob in ("*", "*/*")
        ],
        # the web playground served at GET / (plain files, no build step)
        "ditserve.cluster": ["static/*"],
    },
    include_package_data=True,
)
