# The kubestrata image the manifests run: docker build -t kubestrata:0.1.0 .
FROM python:3.12-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubekit kubekit
COPY virtual_node virtual_node
COPY webhook webhook
COPY descheduler descheduler
COPY multischeduler multischeduler
RUN pip install --no-cache-dir . && rm -rf /src
USER 65532:65532
ENTRYPOINT ["kubestrata"]
