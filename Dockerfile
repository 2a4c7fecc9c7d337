# Build: a release binary of tollgate, without debug info (Cargo.toml's `image` profile).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY rules ./rules
COPY lua ./lua
COPY certs ./certs
COPY benches ./benches
RUN cargo build --profile image --locked --bin tollgate

# Run: a small image, a non-root user, the rules baked in at /etc/tollgate or mounted over it
# (`-v $PWD/rules:/etc/tollgate:ro`: the repository's rules/ holds demo.json). The CA bundle
# for TLS upstreams comes from the build stage, so the image installs no packages.
FROM debian:bookworm-slim
# The embedded store's files (the metering file and the keys made through the admin API) go in
# the working directory, which the user owns: a volume, or an emptyDir under a read-only root.
RUN useradd --system --uid 10001 --no-create-home tollgate \
    && mkdir -p /var/lib/tollgate && chown 10001:10001 /var/lib/tollgate
WORKDIR /var/lib/tollgate
VOLUME /var/lib/tollgate
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /src/target/image/tollgate /usr/local/bin/tollgate
COPY rules/demo.json rules/demo-jwks.json /etc/tollgate/
USER 10001:10001
ENV TOLLGATE_LISTEN=0.0.0.0:8080 \
    TOLLGATE_ADMIN_LISTEN=0.0.0.0:9090 \
    TOLLGATE_RULES=/etc/tollgate/demo.json
EXPOSE 8080 9090
# `tollgate healthcheck` asks the admin listener's /healthz on loopback: no curl in the image.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 CMD ["tollgate", "healthcheck"]
ENTRYPOINT ["tollgate"]
CMD ["serve"]
