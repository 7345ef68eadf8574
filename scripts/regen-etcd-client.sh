#!/usr/bin/env bash
# Regenerates the etcd gRPC code committed in edge-bin/vendor/etcd-client/src/rpc/gen/.
#
# Why it is committed: etcd-client's own build script runs protoc (tonic-prost-build) on every
# clean build, so a machine without protoc could not build `-p waygate` (README's first
# command). The vendored copy has no build script; its generated code is produced here, with
# the same generator versions etcd-client 0.21.1 uses, from the .proto files vendored beside it.
#
#   bash scripts/regen-etcd-client.sh           # rewrite src/rpc/gen/*.rs
#   bash scripts/regen-etcd-client.sh --verify  # fail if the committed code is stale
#
# Needs protoc (Debian: protobuf-compiler libprotobuf-dev) - only here, never for a build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
vendor="$root/edge-bin/vendor/etcd-client"
verify=0
[ "${1:-}" = "--verify" ] && verify=1
command -v protoc >/dev/null || { echo "protoc not found (apt-get install protobuf-compiler libprotobuf-dev)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out="$work/out"
mkdir -p "$out" "$work/gen/src"
cat > "$work/gen/Cargo.toml" <<TOML
[package]
name = "etcd-proto-gen"
version = "0.0.0"
edition = "2021"
publish = false
[workspace]
[build-dependencies]
tonic-prost-build = "=0.14.9"
TOML
echo 'fn main() {}' > "$work/gen/src/main.rs"
cat > "$work/gen/build.rs" <<RS
fn main() {
    let root = "$vendor/proto";
    tonic_prost_build::configure()
        .build_server(false)
        .out_dir("$out")
        .compile_protos(
            &[
                "$vendor/proto/etcd/api/authpb/auth.proto",
                "$vendor/proto/etcd/api/etcdserverpb/rpc.proto",
                "$vendor/proto/etcd/api/mvccpb/kv.proto",
                "$vendor/proto/etcd/server/etcdserver/api/v3election/v3electionpb/v3election.proto",
                "$vendor/proto/etcd/server/etcdserver/api/v3lock/v3lockpb/v3lock.proto",
            ],
            &[root],
        )
        .expect("compile etcd protos");
}
RS
(cd "$work/gen" && CARGO_TARGET_DIR="$work/target" cargo build -q)
# Files that only hold well-known google types the etcd protos import are not used by the
# client code (it includes the five packages below).
dest="$vendor/src/rpc/gen"
if [ $verify = 1 ]; then
  for p in authpb etcdserverpb mvccpb v3electionpb v3lockpb; do
    cmp -s "$out/$p.rs" "$dest/$p.rs" || { echo "stale: $dest/$p.rs (run scripts/regen-etcd-client.sh)" >&2; exit 1; }
  done
  echo "etcd generated code is up to date"
else
  mkdir -p "$dest"
  for p in authpb etcdserverpb mvccpb v3electionpb v3lockpb; do cp "$out/$p.rs" "$dest/$p.rs"; done
  echo "wrote $dest"
fi
