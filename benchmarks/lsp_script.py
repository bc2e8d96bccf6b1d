"""A 300-line training script for benchmarks/lsp_latency.py: one connected program (main() builds the
model, the loaders and the optimizer, and calls the training and evaluation functions), as a user
writes it, with the slow patterns torchopt reports. An edit anywhere in it can change findings in the
functions it is linked with, so the language server cannot split it into independent parts."""

TRAINING_SCRIPT = '''"""Train a small residual network on synthetic images, with evaluation and checkpoints."""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

device = "cuda" if torch.cuda.is_available() else "cpu"
NUM_CLASSES = 10
IMAGE_SIZE = 32


class SyntheticImages(Dataset):
    """Random images whose label is the brightest channel, so a model can learn something."""

    def __init__(self, n, size=IMAGE_SIZE, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, size, size, generator=gen)
        self.labels = self.images.mean(dim=(2, 3)).argmax(dim=1) + 3 * (torch.arange(n) % 3)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if torch.rand(1).item() < 0.5:
            image = image.flip(-1)
        return image, self.labels[i]


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, kernel_size=1, stride=stride), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.skip is None else self.skip(x)
        return F.relu(out + identity)


class SmallResNet(nn.Module):
    def __init__(self, width=32, num_classes=NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, kernel_size=3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = ConvBlock(width, width)
        self.layer2 = ConvBlock(width, 2 * width, stride=2)
        self.layer3 = ConvBlock(2 * width, 4 * width, stride=2)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer3(self.layer2(self.layer1(x)))
        x = x.mean(dim=(2, 3))
        return self.head(self.dropout(x))


def build_loaders(batch_size, train_size=2048, val_size=512):
    train_set = SyntheticImages(train_size, seed=0)
    val_set = SyntheticImages(val_size, seed=1)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=2 * batch_size)
    return train_loader, val_loader


def build_optimizer(model, lr, weight_decay):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


def cosine_lr(step, total_steps, base_lr, warmup=50):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return 0.5 * base_lr * (1 + math.cos(math.pi * progress))


def train_one_epoch(model, loader, optimizer, epoch, step, total_steps, base_lr, log_every=20):
    model.train()
    running_loss = 0.0
    correct = 0
    seen = 0
    start = time.time()
    for batch, (images, labels) in enumerate(loader):
        lr = cosine_lr(step, total_steps, base_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        images = images.to(device)
        labels = labels.to(device)
        optimizer.zero_grad(set_to_none=False)
        logits = model(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
        optimizer.step()
        running_loss += loss.item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        seen += labels.numel()
        step += 1
        if batch % log_every == 0:
            elapsed = time.time() - start
            print(
                f"epoch {epoch} batch {batch}: loss {running_loss / (batch + 1):.4f} "
                f"acc {correct / seen:.3f} lr {lr:.4f} ({elapsed:.1f} s)"
            )
    return running_loss / max(1, batch + 1), correct / max(1, seen), step


def evaluate(model, loader):
    model.eval()
    total_loss = torch.zeros(1).cuda()
    correct = 0
    seen = 0
    for images, labels in loader:
        images = images.to(device)
        labels = labels.to(device)
        logits = model(images)
        total_loss += F.cross_entropy(logits, labels, reduction="sum")
        correct += (logits.argmax(dim=1) == labels).sum().item()
        seen += labels.numel()
    return total_loss.item() / seen, correct / seen


def confusion_matrix(model, loader, num_classes=NUM_CLASSES):
    model.eval()
    matrix = torch.zeros(num_classes, num_classes, dtype=torch.long)
    with torch.no_grad():
        for images, labels in loader:
            preds = model(images.to(device)).argmax(dim=1).cpu()
            for t, p in zip(labels.tolist(), preds.tolist()):
                matrix[t, p] += 1
    return matrix


def per_class_accuracy(matrix):
    totals = matrix.sum(dim=1).clamp(min=1)
    return (matrix.diag().float() / totals.float()).tolist()


def save_checkpoint(path, model, optimizer, epoch, step, best):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "best": best,
    }
    torch.save(state, path)


def load_checkpoint(path, model, optimizer):
    if not os.path.exists(path):
        return 0, 0, 0.0
    state = torch.load(path, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1, state["step"], state["best"]


def count_parameters(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def describe(model, loader):
    images, _ = next(iter(loader))
    print(f"model: {count_parameters(model) / 1e6:.2f} M parameters")
    print(f"batch: {tuple(images.shape)}, {len(loader)} batches per epoch")


def warm_up(model, loader, steps=3):
    model.train()
    for i, (images, _) in enumerate(loader):
        if i >= steps:
            break
        model(images.to(device)).sum().backward()
    model.zero_grad()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--checkpoint", default="checkpoints/last.pt")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_loader, val_loader = build_loaders(args.batch_size)
    model = SmallResNet(width=args.width).to(device)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    describe(model, train_loader)
    warm_up(model, train_loader)
    start_epoch, step, best = 0, 0, 0.0
    if args.resume:
        start_epoch, step, best = load_checkpoint(args.checkpoint, model, optimizer)
    total_steps = args.epochs * len(train_loader)
    history = []
    for epoch in range(start_epoch, args.epochs):
        train_loss, train_acc, step = train_one_epoch(
            model, train_loader, optimizer, epoch, step, total_steps, args.lr
        )
        val_loss, val_acc = evaluate(model, val_loader)
        history.append((epoch, train_loss, train_acc, val_loss, val_acc))
        print(f"epoch {epoch}: train {train_loss:.4f}/{train_acc:.3f} val {val_loss:.4f}/{val_acc:.3f}")
        if val_acc > best:
            best = val_acc
            save_checkpoint(args.checkpoint, model, optimizer, epoch, step, best)
    matrix = confusion_matrix(model, val_loader)
    for cls, acc in enumerate(per_class_accuracy(matrix)):
        print(f"class {cls}: {acc:.3f}")
    return history


def smoke_test():
    model = SmallResNet(width=8).to(device)
    x = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE).to(device)
    out = model(x)
    assert out.shape == (2, NUM_CLASSES)
    scratch = torch.zeros(4, NUM_CLASSES).cuda()
    return out, scratch


def export(model, path="model.pt"):
    model.eval()
    example = torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE).to(device)
    traced = torch.jit.trace(model, example)
    traced.save(path)
    return path


def timing(model, loader, batches=10):
    model.eval()
    times = []
    for i, (images, _) in enumerate(loader):
        if i >= batches:
            break
        images = images.to(device)
        start = time.time()
        model(images)
        torch.cuda.synchronize()
        times.append(time.time() - start)
    return sum(times) / max(1, len(times))


if __name__ == "__main__":
    main()
'''
