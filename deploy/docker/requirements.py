"""Print the requirements of meshtrain (and of the extras named) from pyproject.toml, one per
line, without torch: what the image installs before it copies the sources, so that an edit of
the code rebuilds only the last layer.

    python3 deploy/docker/requirements.py pyproject.toml s3,plot > /tmp/requirements.txt
"""

import re
import sys
import tomllib


def requirements(pyproject: str, extras: str) -> list[str]:
    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    project = data["project"]
    wanted = [e for e in extras.split(",") if e]
    unknown = sorted(set(wanted) - set(project.get("optional-dependencies", {})))
    if unknown:
        raise SystemExit(f"requirements.py: no extra {unknown} in {pyproject}")
    reqs = list(project["dependencies"])
    for extra in wanted:
        reqs += project["optional-dependencies"][extra]
    reqs += data["build-system"]["requires"]  # the sources are installed without build isolation
    # torch comes first, from its own index, and stays what it is
    return [
        r
        for r in dict.fromkeys(reqs)
        if re.match(r"[A-Za-z0-9._-]+", r.strip()).group().lower() != "torch"
    ]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: requirements.py PYPROJECT EXTRA[,EXTRA...]")
    print("\n".join(requirements(sys.argv[1], sys.argv[2])))
