//! JWT identity: the rules' `jwt` settings and JWKS compiled into verifying keys, and a bearer
//! token verified into a caller (key id, tenant, claims). No I/O: the JWKS bytes are handed in.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::HeaderValue;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, errors::ErrorKind};
use serde::Deserialize;
use serde_json::{Map, Value};

/// How bearer tokens of `"identity": "jwt"` routes are verified and who they name.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Jwt")]
pub(crate) struct RawJwt {
    /// A JWKS file, relative to the rules file's directory; read again on every reload.
    pub jwks: String,
    /// The `iss` a token must carry.
    pub issuer: String,
    /// The `aud` a token must carry.
    pub audience: String,
    /// Seconds of clock drift allowed on `exp` and `nbf` (default 30, at most 300).
    #[serde(default)]
    pub leeway_s: Option<u64>,
    /// The claim that is the caller's key id (default `"sub"`).
    #[serde(default)]
    pub key_claim: Option<String>,
    /// The claim that is the caller's tenant (default: the key id).
    #[serde(default)]
    pub tenant_claim: Option<String>,
}

/// Clocks of issuers and gateways drift; more than this would keep expired tokens alive.
pub(crate) const MAX_LEEWAY_S: u64 = 300;
pub(crate) const DEFAULT_LEEWAY_S: u64 = 30;

/// One verifying key from the JWKS, with the one algorithm it may verify.
pub struct JwtKey {
    pub kid: Option<String>,
    pub alg: Algorithm,
    key: DecodingKey,
    /// Made once here, not per request: its sets of issuers and audiences allocate.
    validation: Validation,
}

/// Without the key: an HMAC secret must not reach a log through a debug print of the rules.
impl std::fmt::Debug for JwtKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtKey")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// The compiled `jwt` settings.
#[derive(Debug)]
pub struct JwtConfig {
    pub jwks_path: String,
    pub keys: Vec<JwtKey>,
    pub issuer: String,
    pub audience: String,
    pub leeway_s: u64,
    pub key_claim: String,
    /// `None`: the tenant is the key id.
    pub tenant_claim: Option<String>,
}

/// Why a token was refused; `reason` is what the 401's body says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("this route needs a bearer token (Authorization: Bearer)")]
    Missing,
    #[error("the token is not a JWT")]
    Malformed,
    #[error("the token's algorithm is not accepted")]
    AlgNotAllowed,
    #[error("no key of the JWKS has the token's kid")]
    UnknownKid,
    #[error("the token's algorithm does not match its key's")]
    AlgMismatch,
    #[error("the token's signature does not verify")]
    BadSignature,
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid yet")]
    NotYetValid,
    #[error("the token's issuer is not accepted")]
    WrongIssuer,
    #[error("the token's audience is not accepted")]
    WrongAudience,
    #[error("the token lacks a claim the rules need, or it is not a string")]
    MissingClaim,
    #[error("the token's plan is not in the rules")]
    UnknownPlan,
}

impl TokenError {
    /// The machine-readable reason of the 401's body.
    pub fn reason(self) -> &'static str {
        match self {
            TokenError::Missing => "token_missing",
            TokenError::Malformed => "token_malformed",
            TokenError::AlgNotAllowed => "alg_not_allowed",
            TokenError::UnknownKid => "unknown_kid",
            TokenError::AlgMismatch => "alg_mismatch",
            TokenError::BadSignature => "bad_signature",
            TokenError::Expired => "token_expired",
            TokenError::NotYetValid => "token_not_yet_valid",
            TokenError::WrongIssuer => "wrong_issuer",
            TokenError::WrongAudience => "wrong_audience",
            TokenError::MissingClaim => "missing_claim",
            TokenError::UnknownPlan => "unknown_plan",
        }
    }
}

/// A caller whose token verified: who it is, and the claims limits may key on.
#[derive(Debug, Clone)]
pub struct JwtCaller {
    pub id: Arc<str>,
    /// Escaped where it goes into a bucket name's hash tag, as an API key's tenant is, so a
    /// token and a key of one tenant pay one bucket.
    pub tenant: Arc<str>,
    pub id_header: HeaderValue,
    pub tenant_header: HeaderValue,
    pub claims: Map<String, Value>,
}

impl JwtCaller {
    /// A claim as bucket-name bytes: strings as they are, numbers and booleans as JSON.
    pub fn claim(&self, name: &str) -> Option<Vec<u8>> {
        match self.claims.get(name)? {
            Value::String(s) if !s.is_empty() => Some(s.as_bytes().to_vec()),
            v @ (Value::Number(_) | Value::Bool(_)) => Some(v.to_string().into_bytes()),
            _ => None,
        }
    }
}

/// The one algorithm a JWK may verify, from its key type and curve; a JWK that also names an
/// `alg` must name that one. HS256 comes only from `kty: oct`, so a public key can never serve
/// as an HMAC secret.
fn jwk_alg(jwk: &Jwk) -> Result<Algorithm, String> {
    let (alg, named) = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => (Algorithm::RS256, KeyAlgorithm::RS256),
        AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => {
            (Algorithm::ES256, KeyAlgorithm::ES256)
        }
        AlgorithmParameters::EllipticCurve(p) => {
            return Err(format!("curve {:?} is not accepted; use P-256 (ES256)", p.curve));
        }
        AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
            (Algorithm::EdDSA, KeyAlgorithm::EdDSA)
        }
        AlgorithmParameters::OctetKeyPair(p) => {
            return Err(format!(
                "curve {:?} is not accepted; use Ed25519 (EdDSA)",
                p.curve
            ));
        }
        AlgorithmParameters::OctetKey(_) => (Algorithm::HS256, KeyAlgorithm::HS256),
        _ => {
            return Err("key type is not accepted; use RSA, EC (P-256), OKP (Ed25519) or oct".into());
        }
    };
    match jwk.common.key_algorithm {
        None => Ok(alg),
        Some(a) if a == named => Ok(alg),
        Some(a) => Err(format!(
            "alg {a:?} does not fit the key's type, which verifies {alg:?} only"
        )),
    }
}

/// What every token must carry besides a good signature.
pub(crate) struct Checks<'a> {
    pub issuer: &'a str,
    pub audience: &'a str,
    pub leeway_s: u64,
}

/// Compiles the JWKS bytes into keys; `Err` is (field inside the JWKS, reason).
pub(crate) fn keys(bytes: &[u8], checks: &Checks<'_>) -> Result<Vec<JwtKey>, (String, String)> {
    let set: JwkSet =
        serde_json::from_slice(bytes).map_err(|e| ("(file)".to_string(), format!("not a JWKS: {e}")))?;
    if set.keys.is_empty() {
        return Err(("keys".into(), "holds no key".into()));
    }
    let mut out = Vec::with_capacity(set.keys.len());
    for (i, jwk) in set.keys.iter().enumerate() {
        let field = format!("keys[{i}]");
        let alg = jwk_alg(jwk).map_err(|r| (field.clone(), r))?;
        let key =
            DecodingKey::from_jwk(jwk).map_err(|e| (field.clone(), format!("not a usable key: {e}")))?;
        let kid = jwk.common.key_id.clone();
        if let Some(k) = &kid
            && out.iter().any(|o: &JwtKey| o.kid.as_deref() == Some(k))
        {
            return Err((format!("{field}.kid"), format!("duplicate kid {k:?}")));
        }
        let mut validation = Validation::new(alg);
        validation.leeway = checks.leeway_s;
        validation.validate_nbf = true;
        validation.set_issuer(&[checks.issuer]);
        validation.set_audience(&[checks.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        out.push(JwtKey {
            kid,
            alg,
            key,
            validation,
        });
    }
    Ok(out)
}

/// The algorithms tokens may name; anything else (`none` above all) is refused before any key
/// is looked at.
fn accepted(alg: &str) -> Option<Algorithm> {
    match alg {
        "RS256" => Some(Algorithm::RS256),
        "ES256" => Some(Algorithm::ES256),
        "EdDSA" => Some(Algorithm::EdDSA),
        "HS256" => Some(Algorithm::HS256),
        _ => None,
    }
}

/// The token's header, read by hand: the crate's own parser would fail `alg: none` as
/// malformed JSON, and the caller deserves to hear that the algorithm is what was refused.
fn header(token: &str) -> Result<(Algorithm, Option<String>), TokenError> {
    use base64::Engine as _;
    let mut parts = token.split('.');
    let (Some(h), Some(_), Some(_), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(TokenError::Malformed);
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(h)
        .map_err(|_| TokenError::Malformed)?;
    let v: Map<String, Value> = serde_json::from_slice(&bytes).map_err(|_| TokenError::Malformed)?;
    let alg = match v.get("alg") {
        Some(Value::String(a)) => accepted(a).ok_or(TokenError::AlgNotAllowed)?,
        _ => return Err(TokenError::Malformed),
    };
    let kid = match v.get("kid") {
        None => None,
        Some(Value::String(k)) => Some(k.clone()),
        Some(_) => return Err(TokenError::Malformed),
    };
    Ok((alg, kid))
}

fn from_error(kind: &ErrorKind) -> TokenError {
    match kind {
        ErrorKind::InvalidSignature => TokenError::BadSignature,
        ErrorKind::ExpiredSignature => TokenError::Expired,
        ErrorKind::ImmatureSignature => TokenError::NotYetValid,
        ErrorKind::InvalidIssuer => TokenError::WrongIssuer,
        ErrorKind::InvalidAudience => TokenError::WrongAudience,
        ErrorKind::MissingRequiredClaim(c) if c == "iss" => TokenError::WrongIssuer,
        ErrorKind::MissingRequiredClaim(c) if c == "aud" => TokenError::WrongAudience,
        ErrorKind::MissingRequiredClaim(c) if c == "exp" => TokenError::MissingClaim,
        ErrorKind::InvalidAlgorithm => TokenError::AlgMismatch,
        _ => TokenError::Malformed,
    }
}

impl JwtConfig {
    /// Verifies a bearer token: its algorithm against its key's, the signature, `exp` and
    /// `nbf` with the leeway, `iss` and `aud`; then reads the key id and tenant claims.
    pub fn verify(&self, token: &[u8]) -> Result<JwtCaller, TokenError> {
        let token = std::str::from_utf8(token).map_err(|_| TokenError::Malformed)?;
        let (alg, kid) = header(token)?;
        let candidates: Vec<&JwtKey> = match &kid {
            Some(k) => {
                let key = self
                    .keys
                    .iter()
                    .find(|j| j.kid.as_deref() == Some(k))
                    .ok_or(TokenError::UnknownKid)?;
                vec![key]
            }
            None => self.keys.iter().filter(|j| j.alg == alg).collect(),
        };
        if candidates.is_empty() || candidates.iter().any(|j| j.alg != alg) {
            return Err(TokenError::AlgMismatch);
        }
        let mut last = TokenError::BadSignature;
        let mut claims = None;
        for j in candidates {
            match jsonwebtoken::decode::<Map<String, Value>>(token, &j.key, &j.validation) {
                Ok(d) => {
                    claims = Some(d.claims);
                    break;
                }
                // Another key of the same algorithm may have signed it.
                Err(e) if *e.kind() == ErrorKind::InvalidSignature => {}
                Err(e) => {
                    last = from_error(e.kind());
                    break;
                }
            }
        }
        let claims = claims.ok_or(last)?;
        let text = |name: &str| match claims.get(name) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            _ => Err(TokenError::MissingClaim),
        };
        let id = text(&self.key_claim)?;
        let tenant = match &self.tenant_claim {
            Some(c) => text(c)?,
            None => id.clone(),
        };
        let header = |s: &str| HeaderValue::from_str(s).map_err(|_| TokenError::MissingClaim);
        Ok(JwtCaller {
            id_header: header(&id)?,
            tenant_header: header(&tenant)?,
            id: id.into(),
            tenant: tenant.into(),
            claims,
        })
    }
}

/// A limit's numbers per value of a claim (`"plans"`).
#[derive(Debug)]
pub struct Plans {
    pub claim: String,
    pub numbers: BTreeMap<String, crate::Numbers>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CompileOptions, RulesError, Snapshot};

    const JWKS: &[u8] = include_bytes!("../../tests/fixtures/jwt/jwks.json");

    fn compile(rules: serde_json::Value, jwks: &[u8]) -> Result<Snapshot, RulesError> {
        let read = |name: &str| match name {
            "keys.json" => Ok(jwks.to_vec()),
            other => Err(format!("cannot read {other}: not found")),
        };
        crate::compile::compile_with(
            rules.to_string().as_bytes(),
            "r.json",
            CompileOptions::default(),
            &read,
            &[],
        )
    }

    fn rules() -> serde_json::Value {
        serde_json::json!({
            "version": 1,
            "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
            "limits": {"plan": {"dimension": "key", "plans": {"free": {"rate": "1/1s", "burst": 2}}}},
            "routes": [{"method": "GET", "path": "/v2", "upstream": "u", "identity": "jwt", "cost": {"plan": 1}}],
            "jwt": {"jwks": "keys.json", "issuer": "i", "audience": "a", "tenant_claim": "org"}
        })
    }

    fn refused(r: serde_json::Value, jwks: &[u8]) -> RulesError {
        compile(r, jwks).expect_err("must be refused")
    }

    #[test]
    fn the_jwt_settings_compile_with_one_algorithm_per_key() {
        let snap = compile(rules(), JWKS).unwrap();
        let jwt = snap.jwt.as_ref().unwrap();
        let algs: Vec<_> = jwt
            .keys
            .iter()
            .map(|k| (k.kid.as_deref().unwrap(), k.alg))
            .collect();
        assert_eq!(
            algs,
            [
                ("rsa-1", Algorithm::RS256),
                ("ec-1", Algorithm::ES256),
                ("ed-1", Algorithm::EdDSA),
                ("hs-1", Algorithm::HS256)
            ]
        );
        assert_eq!((jwt.leeway_s, jwt.key_claim.as_str()), (DEFAULT_LEEWAY_S, "sub"));
    }

    #[test]
    fn bad_jwt_settings_name_the_field_and_reason() {
        let mut r = rules();
        r["jwt"]["jwks"] = "gone.json".into();
        let e = refused(r, JWKS);
        assert_eq!(e.field, "jwt.jwks", "{e}");
        assert!(e.reason.contains("gone.json"), "{e}");

        let e = refused(rules(), b"{\"keys\": []}");
        assert!(
            e.field == "jwt.jwks" && e.reason.contains("keys.json: keys: holds no key"),
            "{e}"
        );

        // An RSA key may not claim HS256: its public half would become an HMAC secret.
        let confused = br#"{"keys": [{"kty": "RSA", "alg": "HS256", "kid": "x",
            "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw",
            "e": "AQAB"}]}"#;
        let e = refused(rules(), confused);
        assert!(e.reason.contains("keys[0]: alg HS256 does not fit"), "{e}");

        let mut r = rules();
        r["jwt"]["leeway_s"] = 3600.into();
        assert_eq!(refused(r, JWKS).field, "jwt.leeway_s");

        let mut r = rules();
        r.as_object_mut().unwrap().remove("jwt");
        let e = refused(r, JWKS);
        assert_eq!(e.field, "routes[0].identity", "{e}");

        let mut r = rules();
        r["routes"][0]["key"] = "optional".into();
        assert_eq!(refused(r, JWKS).field, "routes[0].key");
    }

    #[test]
    fn plans_and_claim_limits_are_checked_against_their_routes() {
        let mut r = rules();
        r["routes"][0]["cost"]["plan"] = 3.into();
        let e = refused(r, JWKS);
        assert!(e.reason.contains("above its burst 2 for plan \"free\""), "{e}");

        let mut r = rules();
        r["limits"]["ip"] = serde_json::json!({"dimension": "ip", "rate": "1/1s", "burst": 1,
            "plans": {"free": {"rate": "1/1s", "burst": 1}}});
        assert_eq!(refused(r, JWKS).field, "limits.ip.plans");

        let mut r = rules();
        r["limits"]["user"] = serde_json::json!({"dimension": {"claim": "sub"}, "rate": "1/1s", "burst": 1});
        r["routes"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"method": "GET", "path": "/v1", "upstream": "u", "cost": {"user": 1}}));
        let e = refused(r, JWKS);
        assert!(
            e.field == "routes[1].cost.user" && e.reason.contains("takes API keys"),
            "{e}"
        );

        let mut r = rules();
        r["limits"]["plan"].as_object_mut().unwrap().remove("plans");
        let e = refused(r, JWKS);
        assert!(e.reason.contains("no \"plans\""), "{e}");
    }

    fn token(
        alg: Algorithm,
        kid: &str,
        key: &jsonwebtoken::EncodingKey,
        claims: serde_json::Value,
    ) -> String {
        let mut h = jsonwebtoken::Header::new(alg);
        h.kid = Some(kid.into());
        jsonwebtoken::encode(&h, &claims, key).unwrap()
    }

    #[test]
    fn a_verified_caller_has_its_claims_and_its_tenant_escaped_in_its_tag() {
        let snap = compile(rules(), JWKS).unwrap();
        let key = jsonwebtoken::EncodingKey::from_ed_pem(include_bytes!("../../tests/fixtures/jwt/ed.pem"))
            .unwrap();
        let exp = jsonwebtoken::get_current_timestamp() + 60;
        let claims = |org: &str, plan: &str| serde_json::json!({"sub": "u-1", "org": org, "plan": plan, "iss": "i", "aud": "a", "exp": exp});
        let t = token(Algorithm::EdDSA, "ed-1", &key, claims("a}b:{c", "free"));
        let c = snap.verify_jwt(&snap.routes[0], t.as_bytes()).unwrap();
        assert_eq!((&*c.id, &*c.tenant), ("u-1", "a}b:{c"));
        let batch = crate::plan::build_for(
            &snap,
            &snap.routes[0],
            crate::plan::Caller::Jwt(&c),
            "192.0.2.1".parse().unwrap(),
            crate::Fingerprint::None,
            &http::HeaderMap::new(),
            None,
        )
        .unwrap();
        assert_eq!(
            batch[0].key.as_ref(),
            "rl:{a%7Db%3A%7Bc}:plan",
            "inside the tenant's own tag"
        );
        assert_eq!(batch[0].charge.params.burst, 2, "the free plan's numbers");

        let t = token(Algorithm::EdDSA, "ed-1", &key, claims("o", "gold"));
        assert_eq!(
            snap.verify_jwt(&snap.routes[0], t.as_bytes()).unwrap_err(),
            TokenError::UnknownPlan
        );
    }
}
