# Build: a release binary of tollgate.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY rules ./rules
COPY lua ./lua
COPY benches ./benches
RUN cargo build --release --locked --bin tollgate

# Run: a small image, a non-root user, the rules mounted or baked in at /etc/tollgate.
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home tollgate
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
COPY rules/demo.json /etc/tollgate/rules.json
COPY rules/demo-jwks.json /etc/tollgate/demo-jwks.json
USER 10001:10001
ENV TOLLGATE_LISTEN=0.0.0.0:8080 \
    TOLLGATE_ADMIN_LISTEN=0.0.0.0:9090 \
    TOLLGATE_RULES=/etc/tollgate/rules.json
EXPOSE 8080 9090
ENTRYPOINT ["tollgate"]
CMD ["serve"]
