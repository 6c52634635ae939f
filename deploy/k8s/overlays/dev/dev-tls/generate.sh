#!/bin/sh
# DEV ONLY. Writes the throwaway CA and NATS server certificate of
# overlays/dev (ca.crt, tls.crt, tls.key: the Secret asyncrl-nats-tls).
# The key is public (it is in git): anyone can impersonate a dev NATS
# server with it. The gpu overlays never ship it; create asyncrl-nats-tls
# yourself there (docs/deploy.md, "NATS credentials and TLS").
# Run from this folder to renew (valid 10 years); the deploy checks run the
# dev overlay's roles over TLS with these files.
set -eu
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$tmp/ca.key" -out ca.crt -days 3650 \
  -subj "/CN=asyncrl dev NATS CA (throwaway)" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout tls.key -out "$tmp/tls.csr" -subj "/CN=nats"
cat > "$tmp/ext.cnf" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
# Server (the client port) and client (the routes of a NATS cluster).
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:nats,DNS:nats.asyncrl,DNS:nats.asyncrl.svc,DNS:nats.asyncrl.svc.cluster.local,DNS:*.nats-headless,DNS:*.nats-headless.asyncrl.svc,DNS:*.nats-headless.asyncrl.svc.cluster.local,DNS:localhost,IP:127.0.0.1
EXT
openssl x509 -req -in "$tmp/tls.csr" -CA ca.crt -CAkey "$tmp/ca.key" \
  -CAcreateserial -CAserial "$tmp/ca.srl" -out tls.crt -days 3650 -extfile "$tmp/ext.cnf"
chmod 644 tls.key
