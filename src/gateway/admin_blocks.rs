//! `/admin/blocks` on the admin listener: the blocks of `block_for` limits in force (`GET`),
//! and lifting one (`DELETE ?limit=L&bucket=B`, with the operator's token). A bucket is named
//! as the store names it and the access log shows it (`rl:{ip:203.0.113.7}:login`).

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use jiff::Timestamp;
use serde_json::json;

use crate::admin::Admin;
use crate::respond::{ApiError, Body, json_response};

/// The limit a bucket's name belongs to: the segment after its hash tag (`rl:{TAG}:LIMIT` or
/// `rl:{TAG}:LIMIT:VALUE`). Limit names hold no `:`, and values in names are escaped.
pub(crate) fn limit_of(bucket: &str) -> Option<&str> {
    let rest = bucket.strip_prefix("rl:{")?;
    let (_, after) = rest.split_once("}:")?;
    let limit = after.split(':').next()?;
    (!limit.is_empty()).then_some(limit)
}

fn error(status: StatusCode, error: &str, message: impl Into<String>) -> Response<Body> {
    ApiError::new(status, error)
        .with("message", message.into())
        .into_response()
}

impl Admin {
    pub(crate) async fn blocks_api(
        &self,
        req: Request<Incoming>,
        peer: std::net::SocketAddr,
    ) -> Response<Body> {
        match *req.method() {
            Method::GET => self.list_blocks().await,
            Method::DELETE => {
                if let Some(refused) = self.token_refuses(&req, peer, "lifting a block") {
                    return refused;
                }
                self.lift_block(req.uri().query(), peer).await
            }
            _ => error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "GET lists the blocks, DELETE ?limit=L&bucket=B lifts one",
            ),
        }
    }

    async fn list_blocks(&self) -> Response<Body> {
        let blocks = match self.store.blocks().await {
            Ok(b) => b,
            Err(e) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_unavailable",
                    e.to_string(),
                );
            }
        };
        let snap = self.rules.load();
        let mut seen = Vec::with_capacity(blocks.list.len());
        let mut out = Vec::with_capacity(blocks.list.len());
        for (bucket, end) in &blocks.list {
            let Some(limit) = limit_of(bucket) else { continue };
            // A block of a limit the running rules no longer hold still ends on its own.
            if let Some(l) = snap.limits.iter().find(|l| &*l.name == limit) {
                seen.push((l.name.clone(), Arc::<str>::from(bucket.as_str()), *end));
            }
            let until = Timestamp::from_microsecond(*end as i64).unwrap_or(Timestamp::UNIX_EPOCH);
            out.push(json!({
                "limit": limit,
                "bucket": bucket,
                "until": until.to_string(),
                "seconds_left": (end - blocks.now_us).div_ceil(1_000_000),
            }));
        }
        self.gateway.blocks_listed(&seen, blocks.now_us);
        json_response(StatusCode::OK, json!({"blocks": out}).to_string())
    }

    async fn lift_block(&self, query: Option<&str>, peer: std::net::SocketAddr) -> Response<Body> {
        let (mut limit, mut bucket) = (None, None);
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*k {
                "limit" => limit = Some(v.into_owned()),
                "bucket" => bucket = Some(v.into_owned()),
                other => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "bad_request",
                        format!("unknown parameter {other:?}: name the block with limit and bucket"),
                    );
                }
            }
        }
        let (Some(limit), Some(bucket)) = (limit, bucket) else {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "name the block: DELETE /admin/blocks?limit=L&bucket=B (the bucket as GET /admin/blocks shows it)",
            );
        };
        let snap = self.rules.load();
        if !snap.limits.iter().any(|l| *l.name == *limit && l.block_us > 0) {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("limit: no limit {limit:?} with block_for in the running rules"),
            );
        }
        if limit_of(&bucket) != Some(limit.as_str()) {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("bucket: {bucket:?} is not a bucket of limit {limit:?}"),
            );
        }
        match self.store.lift(&bucket).await {
            Ok(true) => {
                self.gateway.block_lifted(&limit, &bucket);
                self.metrics.admin_change("lift_block");
                tracing::info!(target: "tollgate::audit", action = "lift_block", limit = %limit, bucket = %bucket,
                    at = %Timestamp::now(), peer = %peer, "admin change");
                json_response(
                    StatusCode::OK,
                    json!({"lifted": true, "limit": limit, "bucket": bucket}).to_string(),
                )
            }
            Ok(false) => error(
                StatusCode::NOT_FOUND,
                "not_blocked",
                format!("{bucket:?} has no block in force"),
            ),
            Err(e) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                e.to_string(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::limit_of;

    #[test]
    fn a_bucket_names_its_limit_after_its_tag() {
        assert_eq!(limit_of("rl:{ip:203.0.113.7}:login"), Some("login"));
        assert_eq!(limit_of("rl:{k7}:plan"), Some("plan"));
        assert_eq!(limit_of("rl:{k7}:acct:a%3Ab"), Some("acct"));
        assert_eq!(limit_of("rl:{ip:2001:db8::/64}:unauth"), Some("unauth"));
        assert_eq!(limit_of("rl:{h:x}:"), None);
        assert_eq!(limit_of("plan"), None);
    }
}
