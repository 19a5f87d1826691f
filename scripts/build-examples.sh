#!/usr/bin/env bash
# Builds the Go and Java producer examples against the stubs scripts/gen-stubs.sh makes,
# with Debian's toolchains and gRPC libraries (installed when missing):
#   Go:   golang-go, golang-google-grpc-dev, golang-google-protobuf-dev (GOPATH mode)
#   Java: default JDK, libgrpc-java, libprotobuf-java, libnetty-java, libperfmark-java,
#         libgeronimo-annotation-1.3-spec-java, libnetty-tcnative-java and -jni (TLS with
#         ALPN through OpenSSL: Debian's Netty 4.1.48 cannot negotiate ALPN with the JDK's)
#
#   scripts/build-examples.sh OUT_DIR
#   scripts/build-examples.sh --install-only   (what scripts/test.sh runs up front)
#
# Then, against a server (MAILROOM_CA: its CA, for TLS; MAILROOM_TOKEN: a bearer token):
#   OUT_DIR/go-producer HOST:PORT
#   OUT_DIR/java-producer HOST:PORT      (java with the classpath below)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="${1:?usage: scripts/build-examples.sh OUT_DIR | --install-only}"

debs=(libgrpc-java libprotobuf-java libnetty-java libperfmark-java
  libgeronimo-annotation-1.3-spec-java libnetty-tcnative-java libnetty-tcnative-jni
  golang-google-grpc-dev golang-google-protobuf-dev)
command -v go >/dev/null 2>&1 || debs+=(golang-go)
command -v javac >/dev/null 2>&1 || debs+=(default-jdk-headless)
scripts/need-debs.sh "${debs[@]}"

[ "$out" = "--install-only" ] && exit 0
mkdir -p "$out"
out="$(cd "$out" && pwd)"

scripts/gen-stubs.sh "$out/stubs" >&2

# Go, in GOPATH mode: Debian's Go libraries live in /usr/share/gocode; the stubs go where
# their go_package puts them.
gopath="$out/gopath"
pkg="$gopath/src/github.com/mailroom/mailroom/gen/go"
rm -rf "$gopath" && mkdir -p "$pkg" "$gopath/src/producer"
cp -r "$out/stubs/gen/go/mailroom" "$pkg/"
cp examples/go/producer/main.go "$gopath/src/producer/"
(cd "$gopath/src/producer" && GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" \
  GOCACHE="$out/gocache" GOFLAGS= go build -o "$out/go-producer" .)

# Java: the generated messages and grpc-java stubs with the example, against Debian's jars.
rm -rf "$out/java" && mkdir -p "$out/java"
find "$out/stubs/gen/java" -name '*.java' > "$out/java-sources"
echo "$root/examples/java/Producer.java" >> "$out/java-sources"
# The jars grpc-java's Netty transport needs, by name (a wildcard over /usr/share/java
# would bring every logging binding Debian ships).
jars=(grpc-api grpc-core grpc-context grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub
  protobuf guava perfmark-api netty-buffer netty-codec netty-codec-http netty-codec-http2
  netty-codec-socks netty-common netty-handler netty-handler-proxy netty-resolver
  netty-transport netty-tcnative)
cp="$out/java"
for j in "${jars[@]}"; do cp="$cp:/usr/share/java/$j.jar"; done
printf '%s\n' "$cp" > "$out/java-classpath"
# The stubs' @javax.annotation.Generated is needed to compile only (source retention).
javac -nowarn -d "$out/java" -cp "$cp:/usr/share/java/geronimo-annotation-1.3-spec.jar" \
  @"$out/java-sources" 2> >(grep -v '^Note:' >&2)

# Netty loads OpenSSL's glue as libnetty_tcnative.so; Debian names it libnetty-tcnative.so.
rm -rf "$out/jni" && mkdir -p "$out/jni"
cp -f "$(dpkg -L libnetty-tcnative-jni | grep '/libnetty-tcnative\.so$' | head -1)" \
  "$out/jni/libnetty_tcnative.so"
cat > "$out/java-producer" <<SH
#!/bin/sh
exec java -Djava.library.path="$out/jni" -cp "$cp" Producer "\$@"
SH
chmod +x "$out/java-producer"

echo "built: $out/go-producer, $out/java-producer" >&2
