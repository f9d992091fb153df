#!/bin/sh
# Self-signed option (no cert-manager): make a CA and the webhook's serving certificate with openssl,
# store them in Secret kvguard-webhook-tls and put the CA into the webhook configuration's caBundle.
#   manifests/webhook/self-signed.sh            # after `kubectl apply -k manifests/`
#   manifests/webhook/self-signed.sh --out DIR  # only write ca.crt, tls.crt, tls.key into DIR
# Re-run before the certificate expires (DAYS, default 365); the operator reloads the files.
set -eu
NAMESPACE=${NAMESPACE:-kvguard-system}
SERVICE=kvguard-operator-webhook
DAYS=${DAYS:-365}
OUT=""
if [ "${1:-}" = "--out" ]; then OUT=$2; mkdir -p "$OUT"; fi
DIR=${OUT:-$(mktemp -d)}
EC="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $EC -keyout "$DIR/ca.key" -out "$DIR/ca.crt" -days "$DAYS" -subj "/CN=kvguard-webhook-ca" 2>/dev/null
openssl req $EC -keyout "$DIR/tls.key" -out "$DIR/tls.csr" -subj "/CN=$SERVICE.$NAMESPACE.svc" 2>/dev/null
printf 'subjectAltName=DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\n' "$SERVICE" "$NAMESPACE" "$SERVICE" "$NAMESPACE" > "$DIR/san.ext"
openssl x509 -req -in "$DIR/tls.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial \
  -out "$DIR/tls.crt" -days "$DAYS" -extfile "$DIR/san.ext" 2>/dev/null
rm -f "$DIR/ca.key" "$DIR/tls.csr" "$DIR/san.ext" "$DIR/ca.srl"   # the CA key is not kept: re-run to renew
[ -n "$OUT" ] && exit 0
kubectl -n "$NAMESPACE" create secret generic kvguard-webhook-tls \
  --from-file=tls.crt="$DIR/tls.crt" --from-file=tls.key="$DIR/tls.key" --from-file=ca.crt="$DIR/ca.crt" \
  --dry-run=client -o yaml | kubectl apply -f -
CA_BUNDLE=$(base64 < "$DIR/ca.crt" | tr -d '\n')
PATCH=""  # every webhook of the configuration (InferenceModels, InferencePolicies) trusts the CA
for i in 0 1; do PATCH="$PATCH${PATCH:+,}{\"op\":\"add\",\"path\":\"/webhooks/$i/clientConfig/caBundle\",\"value\":\"$CA_BUNDLE\"}"; done
kubectl patch validatingwebhookconfiguration kvguard-inferencemodels --type=json -p "[$PATCH]"
rm -rf "$DIR"
kubectl -n "$NAMESPACE" rollout restart deployment/kvguard-operator   # pick up the Secret if it was new
kubectl -n "$NAMESPACE" rollout status deployment/kvguard-operator --timeout=300s   # the webhook serves: policies may be applied
