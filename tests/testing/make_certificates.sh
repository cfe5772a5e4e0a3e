#!/bin/sh
# Certificates for the TLS tests (C++ tests/testing/tls_certificates.h, Python
# kvmem_testing.make_certificates), made by the openssl command in the folder given
# (made if need be; files of these names are replaced): CAs "ca" and "other"; "server", for localhost and 127.0.0.1, signed by
# ca; clients "alice" and "bob" signed by ca, and "mallory", whose common name is alice,
# signed by other. Each NAME has NAME.pem and NAME.key.
set -e
mkdir -p "$1"
cd "$1"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1.key" 2>/dev/null; }
ca() { key "$1"; openssl req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "/CN=$1"; }
cert() {
  key "$1"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$2"
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -out "$1.pem" \
    -days 2 -extfile "$1.ext" 2>/dev/null
}
ca ca
ca other
cert server localhost ca
cert alice alice ca
cert bob bob ca
cert mallory alice other
