//! Stores that fail on purpose, for tests of what stands in front of a store: one copy that the
//! store's own tests and the workspace's tests share.

use std::ops::Deref;

use tollgate_store::{Adjusted, BoxFuture, CheckFuture, CheckItem, Outcome, Store, StoreError};

/// A store whose checks reach `0` but whose every change after a check is lost, as when a
/// cluster slot's master can't be reached between the check and the give-back.
pub struct LostChanges<S>(pub S);

impl<S> Store for LostChanges<S>
where
    S: Deref + Send + Sync + 'static,
    S::Target: Store,
{
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        self.0.check(batch)
    }

    fn kind(&self) -> &'static str {
        self.0.kind()
    }

    fn adjust<'a>(
        &'a self,
        _batch: &'a [CheckItem],
        _outcome: &'a Outcome,
        _units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "connection refused".into(),
        ))))
    }

    fn remote(&self) -> bool {
        true
    }
}
