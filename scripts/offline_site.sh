# Sourced by the GPU scripts: on a node that cannot reach a package index, what
# tools/te_offline_bundle.py put in .whl/ (te_site.tar.xz, a megatron-core wheel) is unpacked into
# $TE_SITE (default /tmp/te_site) once, and put first on PYTHONPATH, which the jobs the tests start
# keep (scripts/child_env.py). Without .whl/ nothing changes.
offline_site=${TE_SITE:-/tmp/te_site}
if [ -f .whl/te_site.tar.xz ] && [ ! -d "$offline_site/transformer_engine" ]; then
    mkdir -p "$offline_site" && tar xJf .whl/te_site.tar.xz -C "$offline_site" \
        || { echo "error: could not unpack .whl/te_site.tar.xz into $offline_site" >&2; exit 3; }
fi
if compgen -G ".whl/megatron_core-*.whl" > /dev/null && [ ! -d "$offline_site/megatron/core" ] \
        && ! python3 -c "import megatron.core" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$offline_site" .whl/megatron_core-*.whl \
        || { echo "error: could not install .whl/megatron_core-*.whl into $offline_site" >&2; exit 3; }
fi
if [ -d "$offline_site" ] && [[ ":${PYTHONPATH:-}:" != *":$offline_site:"* ]]; then
    export PYTHONPATH="$offline_site${PYTHONPATH:+:$PYTHONPATH}"
fi
